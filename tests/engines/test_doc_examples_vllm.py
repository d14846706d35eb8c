"""The documentation's examples that need vLLM (``<!-- examples: vllm -->``) run as written, here in
the engines' environment, with the harness of tests/integration/test_doc_examples.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# Like the other tests here, for the engines' own environment (`make test-engines`): skipped in .venv.
pytest.importorskip("vllm", reason="needs vLLM: `make test-engines` runs tests/engines in .venv-engines")

_HARNESS = Path(__file__).resolve().parents[1] / "integration" / "test_doc_examples.py"
_spec = importlib.util.spec_from_file_location("doc_examples_harness", _HARNESS)
assert _spec is not None and _spec.loader is not None
harness = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = harness  # dataclasses look their module up by name
_spec.loader.exec_module(harness)


@pytest.mark.timeout(harness.EXAMPLE_TIMEOUT)
@pytest.mark.parametrize("page", harness.pages_with_examples(vllm=True))
def test_vllm_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    harness.run_page(page, tmp_path, monkeypatch)
