"""docs/explanation/scaling.md and the scaling model say what the codecs put on the wire: bytes per element
come from ``tensorwire.compression`` (int8 scales per 4096 elements, sign's one scale per shard),
not from numbers written by hand, and the doc's table is what the model prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorwire.bench import scaling
from tensorwire.compression.codecs import codec_for

DOC = Path(__file__).resolve().parents[2] / "docs" / "explanation" / "scaling.md"
WIRE_NAMES = [  # label keyword -> codec wire name (first match wins)
    ("topk 1% + fp16", "topk:0.01+fp16"),
    ("topk 1%", "topk:0.01"),
    ("int8", "int8"),
    ("sign", "sign"),
    ("fp16", "fp16"),
    ("fp32", "fp32"),
]


def _wire_name(label: str) -> str:
    return next(name for key, name in WIRE_NAMES if label.startswith(key))


@pytest.mark.parametrize("label", sorted(scaling.CODECS))
def test_the_models_bytes_per_element_are_the_codecs(label: str) -> None:
    n = 1 << 20
    assert scaling.CODECS[label] == pytest.approx(codec_for(_wire_name(label)).payload_bytes(n) / n, rel=1e-9)


def test_the_doc_embeds_the_models_table_and_no_stale_claims() -> None:
    text = DOC.read_text()
    assert scaling.markdown_table(10**8, 16, 25.0) in text
    assert "per 1024" not in text and "4/1024" not in text
    assert "workers push fp32" not in text
