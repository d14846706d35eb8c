"""tests/engines: tensorwire.vllm against a real vLLM engine (its CPU build). They run in the
engines' own virtual environment (`make test-engines`, which makes .venv-engines); without vLLM
the folder is skipped, so `make test` stays small."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-engines` runs these in .venv-engines")
