"""A hostile layout document (``<prefix>/_layout``, what a peer put beside its shards) is refused
by ``sharded.load_state_dict`` before any byte of a shard moves: boxes outside the global shape,
overlapping, leaving gaps, absurd sizes and counts, stored tensors whose size, shape or dtype is
not their box's, a layout that is not a document. Each generation also holds a good parameter
(``g``) that the same read would fetch: it stays untouched, so nothing was read. Each case fails
with its check removed from sharded/layout.py or sharded/__init__.py (the read goes ahead and
the server refuses a range, or wrong bytes land)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

import tensorwire
from tensorwire import sharded
from tensorwire.errors import LayoutMismatch

GOOD = {"dtype": "float32", "shape": [4], "mesh": [], "placements": [],
        "boxes": [{"offsets": [0], "sizes": [4], "tensor": "g/o0"}]}  # fmt: skip


def _box(offsets: list[int], sizes: list[int], tensor: str) -> dict[str, object]:
    return {"offsets": offsets, "sizes": sizes, "tensor": tensor}


def _entry(boxes: list[dict[str, object]], **changes: object) -> dict[str, object]:
    entry: dict[str, object] = {"dtype": "float32", "shape": [4, 2], "mesh": [2], "placements": ["S(0)"]}
    entry["boxes"] = boxes
    entry.update(changes)
    return entry


TOP = _box([0, 0], [2, 2], "w/o0_0")
HALVES = [TOP, _box([2, 0], [2, 2], "w/o2_0")]


def _second(offsets: list[int], sizes: list[int], tensor: str = "w/o2_0") -> dict[str, object]:
    """``w`` as the top half and a second box."""
    return _entry([TOP, _box(offsets, sizes, tensor)])


CASES = {
    "a box outside the global shape": (_second([2, 0], [3, 2]), "outside"),
    "overlapping boxes": (
        _entry([_box([0, 0], [3, 2], "w/o0_0"), _box([2, 0], [2, 2], "w/o2_0")]),
        "overlap",
    ),
    "a gap": (_second([3, 0], [1, 2]), "cover 6 of its 8"),
    "absurd sizes": (_entry(HALVES, shape=[4, 1 << 63]), "non-negative integers"),
    "absurd dims": (_entry(HALVES, shape=[1] * 33), "at most 32"),
    "absurd counts": (_entry([_box([0, 0], [1, 1], "w/o0_0")] * 4097), "at most 4096"),
    "a box stored in a bigger tensor": (_second([2, 0], [2, 2], "w/big"), "stored as"),
    "a box naming no stored tensor": (_second([2, 0], [2, 2], "w/gone"), "lacks"),
    "a box stored as another dtype": (_second([2, 0], [2, 2], "w/half"), "stored as"),
    "a dtype tensorwire does not know": (_entry(HALVES, dtype="float128"), "dtype"),
}


@pytest.fixture(scope="module")
def client() -> Iterator[tensorwire.Client]:
    with tensorwire.ServerThread() as srv, tensorwire.connect(srv.url) as c:
        yield c


def _publish(client: tensorwire.Client, prefix: str, doc: bytes | torch.Tensor) -> None:
    layout = doc if isinstance(doc, torch.Tensor) else torch.frombuffer(bytearray(doc), dtype=torch.uint8)
    client.publish(prefix, {
        "_layout": layout, "g/o0": torch.arange(4.0),
        "w/o0_0": torch.ones(2, 2), "w/o2_0": torch.ones(2, 2), "w/big": torch.ones(2, 3),
        "w/half": torch.ones(2, 2, dtype=torch.float16),
    })  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_layout_is_refused_before_any_byte_moves(client: tensorwire.Client, case: str) -> None:
    entry, says = CASES[case]
    prefix = "hostile/" + case.replace(" ", "-")
    _publish(client, prefix, json.dumps({"format": 1, "params": {"g": GOOD, "w": entry}}).encode())
    into = {"g": torch.zeros(4), "w": torch.zeros(4, 2)}
    with pytest.raises(LayoutMismatch, match=says) as info:
        sharded.load_state_dict(client, prefix, into)
    assert "'w'" in str(info.value)  # it names the parameter
    assert not into["g"].any() and not into["w"].any()  # nothing was read


def test_the_good_document_reads(client: tensorwire.Client) -> None:
    """The control: the same generation with a sound layout of ``w`` reads."""
    _publish(
        client, "hostile/none", json.dumps({"format": 1, "params": {"g": GOOD, "w": _entry(HALVES)}}).encode()
    )
    into = {"g": torch.zeros(4), "w": torch.zeros(4, 2)}
    sharded.load_state_dict(client, "hostile/none", into)
    assert torch.equal(into["g"], torch.arange(4.0)) and torch.equal(into["w"], torch.ones(4, 2))


@pytest.mark.parametrize(
    ("layout", "says"),
    [
        (torch.zeros(3), "not a layout document"),
        (torch.zeros(2, 2, dtype=torch.uint8), "not a layout document"),
        (torch.frombuffer(bytearray(b"\xff\xfe"), dtype=torch.uint8), "not JSON"),
    ],
)
def test_a_layout_that_is_not_a_document_is_refused(
    client: tensorwire.Client, layout: torch.Tensor, says: str
) -> None:
    prefix = f"hostile/doc{layout.dtype}{layout.dim()}{layout.numel()}".replace(".", "")
    _publish(client, prefix, layout)
    into = {"g": torch.zeros(4)}
    with pytest.raises(LayoutMismatch, match=says):
        sharded.load_state_dict(client, prefix, into)
    assert not into["g"].any()
