"""The layout math of tensorwire.sharded (sharded/layout.py), no sockets: overlap runs cover a
wanted shard exactly once and, applied as byte copies, rebuild it from any stored tiling; tilings
with boxes outside, overlaps or gaps are refused naming the parameter; layouts that disagree are
refused naming both; the layout document round-trips and refuses what a hostile peer could send."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorwire.errors import LayoutMismatch
from tensorwire.sharded.layout import (
    Box,
    ShardLayout,
    Stored,
    check_tiling,
    decode_document,
    encode_document,
    merge,
    overlap_runs,
)


def _cuts(n: int, draw: st.DrawFn) -> list[int]:
    """Split points of a dimension of ``n``: 0 = c0 <= c1 <= ... <= ck = n (empty pieces allowed)."""
    inner = draw(st.lists(st.integers(0, n), max_size=3))
    return [0, *sorted(inner), n]


@st.composite
def tilings(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A global shape (0 to 3 dims) and a grid tiling of it (uneven, some pieces empty)."""
    shape = tuple(draw(st.lists(st.integers(1, 7), max_size=3)))
    grids = [_cuts(n, draw) for n in shape]
    boxes = []
    for corner in np.ndindex(*(len(g) - 1 for g in grids)):
        offsets = tuple(g[i] for g, i in zip(grids, corner, strict=True))
        sizes = tuple(g[i + 1] - g[i] for g, i in zip(grids, corner, strict=True))
        boxes.append(Box(offsets, sizes))
    return shape, boxes


def _apply(
    shape: tuple[int, ...], stored: list[Box], wanted: Box, itemsize: int, whole: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``wanted``'s bytes rebuilt from the stored shards' bytes by the runs; and how often each
    destination byte was written."""
    dest = np.zeros(wanted.numel * itemsize, dtype=np.uint8)
    hits = np.zeros(wanted.numel * itemsize, dtype=np.int32)
    for box in stored:
        index = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes, strict=True))
        shard = np.ascontiguousarray(whole[index]).view(np.uint8).reshape(-1)
        for src, dst, length in overlap_runs(box, wanted, itemsize):
            dest[dst : dst + length] = shard[src : src + length]
            hits[dst : dst + length] += 1
    return dest, hits


@settings(max_examples=200, deadline=None)
@given(stored=tilings(), data=st.data(), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_runs_of_any_tiling_rebuild_any_wanted_box_exactly_once(
    stored: tuple[tuple[int, ...], list[Box]], data: st.DataObject, itemsize: int
) -> None:
    shape, boxes = stored
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[itemsize]
    whole = np.arange(math.prod(shape), dtype=dtype).reshape(shape)
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets, strict=True))
    wanted = Box(offsets, sizes)
    dest, hits = _apply(shape, boxes, wanted, itemsize, whole)
    assert (hits == 1).all()  # every byte of the wanted shard, exactly once
    index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
    assert dest.tobytes() == np.ascontiguousarray(whole[index]).tobytes()


def test_full_rows_coalesce_into_one_run_and_a_column_cut_gives_one_run_per_row() -> None:
    assert overlap_runs(Box((0, 0), (4, 6)), Box((2, 0), (4, 6)), 4) == [(2 * 24, 0, 2 * 24)]
    runs = overlap_runs(Box((0, 0), (4, 6)), Box((0, 3), (4, 3)), 1)
    assert runs == [(3, 0, 3), (9, 3, 3), (15, 6, 3), (21, 9, 3)]
    assert overlap_runs(Box((0,), (3,)), Box((3,), (3,)), 4) == []  # disjoint
    assert overlap_runs(Box((), ()), Box((), ()), 8) == [(0, 0, 8)]  # a 0-dim tensor


def _layout(shape: tuple[int, ...], boxes: list[Box]) -> ShardLayout:
    stored = tuple(Stored(b, i, f"w/{b.key()}") for i, b in enumerate(boxes))
    return ShardLayout("layer.0.w", torch.float32, shape, (len(boxes),), ("S(0)",), stored)


@given(tilings())
def test_grid_tilings_pass(stored: tuple[tuple[int, ...], list[Box]]) -> None:
    check_tiling(_layout(*stored))


@pytest.mark.parametrize(
    ("boxes", "says"),
    [
        ([Box((0, 0), (4, 5)), Box((4, 0), (4, 5))], "outside"),  # rows 4..8 of a 7-row tensor
        ([Box((0, 0), (4, 5)), Box((3, 0), (4, 5))], "overlap"),
        ([Box((0, 0), (3, 5)), Box((4, 0), (3, 5))], "cover 30 of its 35"),  # row 3 missing
        ([Box((0, 0), (7, 5)), Box((0, 0), (7, 5))], "overlap"),  # the same box twice
        ([Box((0,), (7,))], "dimensions"),
    ],
)
def test_bad_tilings_are_refused_naming_the_parameter(boxes: list[Box], says: str) -> None:
    with pytest.raises(LayoutMismatch, match=says) as info:
        check_tiling(_layout((7, 5), boxes))
    assert "layer.0.w" in str(info.value)


def _rank(
    box: Box, placements: tuple[str, ...] = ("S(0)",), shape: tuple[int, ...] = (7, 5)
) -> dict[str, ShardLayout]:
    return {"w": ShardLayout("w", torch.bfloat16, shape, (2,), placements, (Stored(box, 0, ""),))}


def test_merge_stores_a_replicated_box_once_by_the_lowest_rank() -> None:
    whole = Box((0, 0), (7, 5))
    merged = merge([_rank(whole, ("R",)), _rank(whole, ("R",)), _rank(whole, ("R",))])
    assert merged["w"].boxes == (Stored(whole, 0, "w/o0_0"),)
    halves = merge([_rank(Box((0, 0), (4, 5))), _rank(Box((4, 0), (3, 5)))])
    assert [(s.rank, s.tensor) for s in halves["w"].boxes] == [(0, "w/o0_0"), (1, "w/o4_0")]


def test_merge_refuses_ranks_that_disagree_naming_both_layouts() -> None:
    with pytest.raises(
        LayoutMismatch, match=r"'w': rank 1 holds it as bfloat16 \[7, 6\].*rank 0 as bfloat16 \[7, 5\]"
    ):
        merge([_rank(Box((0, 0), (4, 5))), _rank(Box((4, 0), (3, 6)), shape=(7, 6))])
    with pytest.raises(LayoutMismatch, match="S\\(1\\)"):
        merge([_rank(Box((0, 0), (4, 5))), _rank(Box((4, 0), (3, 5)), ("S(1)",))])
    with pytest.raises(LayoutMismatch, match="overlap"):  # both claim row 3
        merge([_rank(Box((0, 0), (4, 5))), _rank(Box((3, 0), (4, 5)))])
    with pytest.raises(LayoutMismatch, match="cover 20 of its 35"):  # the same box twice: a gap
        merge([_rank(Box((0, 0), (4, 5))), _rank(Box((0, 0), (4, 5)))])


def test_the_document_round_trips() -> None:
    merged = merge([_rank(Box((0, 0), (4, 5))), _rank(Box((4, 0), (3, 5)))])
    back = decode_document(encode_document(merged))
    assert back["w"].boxes[1].box == Box((4, 0), (3, 5)) and back["w"].boxes[1].tensor == "w/o4_0"
    assert back["w"].same_placement(merged["w"])


def _doc(**changes: object) -> bytes:
    boxes = [
        {"offsets": [0, 0], "sizes": [2, 2], "tensor": "w/o0_0"},
        {"offsets": [2, 0], "sizes": [2, 2], "tensor": "w/o2_0"},
    ]
    entry: dict[str, object] = {"dtype": "float32", "shape": [4, 2], "mesh": [2], "placements": ["S(0)"]}
    entry["boxes"] = boxes
    entry.update(changes)
    return json.dumps({"format": 1, "params": {"w": entry}}).encode()


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        (b"\xff not json", "not JSON"),
        (b"[1, 2]", "not format 1"),
        (_doc(dtype="float128"), "dtype"),
        (_doc(dtype=["float32"]), "dtype"),
        (_doc(shape=[4, -2]), "non-negative"),
        (_doc(shape=[4, 2.5]), "non-negative"),
        (_doc(shape=[1] * 40), "at most 32"),
        (_doc(boxes=[{"offsets": [0, 0], "sizes": [4, 3], "tensor": "w/o0_0"}]), "outside"),
        (_doc(boxes=[{"offsets": [0, 0], "sizes": [2, 2], "tensor": "w/o0_0"}]), "cover 4 of its 8"),
        (
            _doc(
                boxes=[
                    {"offsets": [0, 0], "sizes": [3, 2], "tensor": "a"},
                    {"offsets": [2, 0], "sizes": [2, 2], "tensor": "b"},
                ]
            ),
            "overlap",
        ),
        (_doc(boxes=[{"offsets": [0], "sizes": [4], "tensor": "w"}]), "dimensions"),
        (_doc(boxes=[{"offsets": [0, 0], "sizes": [4, 2]}]), "naming its tensor"),
        (_doc(boxes=[{"offsets": [0, 0], "sizes": [1, 1], "tensor": "w"}] * 5000), "at most 4096"),
        (_doc(shape=[1 << 62, 2]), "non-negative"),
    ],
)
def test_hostile_documents_are_refused(doc: bytes, says: str) -> None:
    with pytest.raises(LayoutMismatch, match=says):
        decode_document(doc)
