"""The layout math of sharded state (no sockets): which rank holds which box of which parameter,
whether a set of boxes tiles the global shape, which byte runs of a stored shard a wanted shard
needs, and the layout document that travels beside the shards (``<prefix>/_layout``).

A ``Box`` is a block of a parameter: its offsets and sizes per dimension. A ``ShardLayout`` is a
parameter's dtype, global shape, mesh shape and placements (as strings: ``"S(0)"``, ``"R"``) and
its stored boxes, each with the rank that stores it and the tensor it is stored as; a box held by
several ranks (Replicate) is stored once, by the lowest of them. Every check raises
``LayoutMismatch`` (a ValueError) naming the parameter.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from tensorwire.errors import InvalidTensor, LayoutMismatch
from tensorwire.wire.dtypes import dtype_from_name, dtype_name

LAYOUT_KEY = "_layout"  # the layout document's key under the prefix
FORMAT = 1
MAX_DIMS = 32
MAX_BOXES = 4096  # boxes per parameter in a layout document
MAX_PARAMS = 1 << 20
MAX_DOCUMENT_BYTES = 256 << 20


@dataclass(frozen=True, slots=True, order=True)
class Box:
    """Elements ``offsets[d] .. offsets[d] + sizes[d]`` of every dimension ``d``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def key(self) -> str:
        """The box's part of its stored tensor's name: ``o0_128`` (``o`` for a 0-dim tensor)."""
        return "o" + "_".join(str(o) for o in self.offsets)

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=True)) + "]"


@dataclass(frozen=True, slots=True)
class Stored:
    """A box as stored: by ``rank`` (the lowest that holds it), as tensor ``tensor`` (a key under
    the prefix)."""

    box: Box
    rank: int
    tensor: str


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """One parameter's placement (module docstring)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    mesh: tuple[int, ...] = ()  # () for a plain tensor
    placements: tuple[str, ...] = ()
    boxes: tuple[Stored, ...] = field(default=())

    def describe(self) -> str:
        how = f" on mesh {list(self.mesh)} as {list(self.placements)}" if self.mesh else " (plain)"
        return f"{dtype_name(self.dtype)} {list(self.shape)}{how}"

    def same_placement(self, other: ShardLayout) -> bool:
        return (self.dtype, self.shape, self.mesh, self.placements) == (
            other.dtype, other.shape, other.mesh, other.placements,
        )  # fmt: skip


# -- one layout from every rank's ---------------------------------------------------------------
def merge(parts: Sequence[Mapping[str, ShardLayout]]) -> dict[str, ShardLayout]:
    """The layout of a state whose ranks (index = rank) describe their own boxes in ``parts``:
    the same parameters with the same dtype, global shape and placements on every rank (else
    LayoutMismatch naming the parameter and both layouts); boxes held by several ranks are stored
    once, by the lowest; the boxes must tile each parameter (``check_tiling``)."""
    names = set(parts[0]) if parts else set()
    for rank, part in enumerate(parts):
        if set(part) != names:
            odd = sorted(set(part) ^ names)[:3]
            raise LayoutMismatch(f"rank {rank} and rank 0 hold different parameters (e.g. {odd})")
    merged: dict[str, ShardLayout] = {}
    for name in sorted(names):
        first = parts[0][name]
        holders: dict[Box, int] = {}
        for rank, part in enumerate(parts):
            mine = part[name]
            if not mine.same_placement(first):
                raise LayoutMismatch(
                    f"{name!r}: rank {rank} holds it as {mine.describe()}, rank 0 as {first.describe()}"
                )
            for stored in mine.boxes:
                holders.setdefault(stored.box, rank)  # ranks in order: the lowest keeps it
        boxes = tuple(Stored(b, r, f"{name}/{b.key()}") for b, r in sorted(holders.items()) if b.numel)
        layout = replace(first, boxes=boxes)
        check_tiling(layout)
        merged[name] = layout
    return merged


def check_tiling(layout: ShardLayout) -> None:
    """LayoutMismatch unless the (non-empty) boxes lie inside the global shape, overlap nowhere
    and leave no gap: together, every element exactly once."""
    shape, name = layout.shape, layout.name
    boxes = [s.box for s in layout.boxes if s.box.numel]
    for box in boxes:
        if len(box.offsets) != len(shape) or len(box.sizes) != len(shape):
            raise LayoutMismatch(
                f"{name!r}: box {box.offsets}+{box.sizes} does not have {len(shape)} dimensions"
            )
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(box.offsets, box.sizes, shape, strict=True)):
            raise LayoutMismatch(f"{name!r}: box {box} lies outside its global shape {list(shape)}")
    ordered = sorted(boxes)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if shape and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                break  # sorted by the first offset: no later box reaches back into ``a``
            if intersect(a, b) is not None:
                raise LayoutMismatch(f"{name!r}: boxes {a} and {b} overlap")
    covered = sum(b.numel for b in boxes)
    if covered != math.prod(shape):
        raise LayoutMismatch(f"{name!r}: its boxes cover {covered} of its {math.prod(shape)} elements")


def intersect(a: Box, b: Box) -> Box | None:
    """The elements ``a`` and ``b`` share, or None (an empty intersection)."""
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))


# -- the byte runs of an overlap ----------------------------------------------------------------
def overlap_runs(stored: Box, wanted: Box, itemsize: int) -> list[tuple[int, int, int]]:
    """The bytes of ``stored`` (a row-major shard) that ``wanted`` (another) needs, as
    ``(offset in stored, offset in wanted, length)`` runs; runs contiguous in both are one run (a
    block of full rows is one run)."""
    common = intersect(stored, wanted)
    if common is None or not common.numel:
        return []
    ndim = len(common.sizes)
    k = ndim - 1 if ndim else 0  # dims k.. form each run: every dim after k full in all three
    while k > 0 and stored.sizes[k] == common.sizes[k] == wanted.sizes[k]:
        k -= 1
    length = math.prod(common.sizes[k:]) * itemsize
    src_strides, dst_strides = _strides(stored.sizes, itemsize), _strides(wanted.sizes, itemsize)
    src0 = sum((c - s) * st for c, s, st in zip(common.offsets, stored.offsets, src_strides, strict=True))
    dst0 = sum((c - w) * st for c, w, st in zip(common.offsets, wanted.offsets, dst_strides, strict=True))
    runs = []
    for index in itertools.product(*(range(n) for n in common.sizes[:k])):
        src = src0 + sum(i * st for i, st in zip(index, src_strides, strict=False))
        dst = dst0 + sum(i * st for i, st in zip(index, dst_strides, strict=False))
        runs.append((src, dst, length))
    return runs


def _strides(sizes: Sequence[int], itemsize: int) -> list[int]:
    strides, step = [], itemsize
    for n in reversed(sizes):
        strides.append(step)
        step *= n
    return strides[::-1]


# -- the layout document ------------------------------------------------------------------------
def encode_document(layouts: Mapping[str, ShardLayout]) -> bytes:
    """``<prefix>/_layout``: UTF-8 JSON, per parameter its dtype, global shape, mesh shape,
    placements and stored boxes (offsets, sizes, tensor key)."""
    params = {
        name: {
            "dtype": dtype_name(lay.dtype),
            "shape": list(lay.shape),
            "mesh": list(lay.mesh),
            "placements": list(lay.placements),
            "boxes": [
                {"offsets": list(s.box.offsets), "sizes": list(s.box.sizes), "tensor": s.tensor}
                for s in lay.boxes
            ],
        }
        for name, lay in layouts.items()
    }
    return json.dumps({"format": FORMAT, "params": params}, sort_keys=True).encode()


def decode_document(data: bytes) -> dict[str, ShardLayout]:
    """The layouts of a document a peer sent: every field checked (types, counts, dimensions,
    sizes; each parameter's boxes tile it), LayoutMismatch otherwise. Never more than JSON."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise LayoutMismatch(f"a layout document of {len(data)} bytes: at most {MAX_DOCUMENT_BYTES}")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise LayoutMismatch(f"the layout document is not JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("params"), dict):
        raise LayoutMismatch(f"the layout document is not format {FORMAT}")
    params: dict[str, Any] = doc["params"]
    if len(params) > MAX_PARAMS:
        raise LayoutMismatch(f"the layout document names {len(params)} parameters: at most {MAX_PARAMS}")
    layouts = {}
    for name, entry in params.items():
        layout = _decode_param(name, entry)
        check_tiling(layout)
        layouts[name] = layout
    return layouts


def _decode_param(name: str, entry: object) -> ShardLayout:
    if not isinstance(entry, dict):
        raise LayoutMismatch(f"{name!r}: its layout entry is not an object")
    given = entry.get("dtype")
    try:
        dtype = dtype_from_name(given) if isinstance(given, str) else None
    except InvalidTensor:
        dtype = None
    if dtype is None:
        raise LayoutMismatch(f"{name!r}: dtype {given!r} is not one tensorwire knows")
    shape = _ints(name, "shape", entry.get("shape"))
    mesh = _ints(name, "mesh", entry.get("mesh"))
    placements = entry.get("placements")
    if not isinstance(placements, list) or not all(isinstance(p, str) and len(p) < 64 for p in placements):
        raise LayoutMismatch(f"{name!r}: placements must be a list of short strings")
    boxes = entry.get("boxes")
    if not isinstance(boxes, list) or len(boxes) > MAX_BOXES:
        raise LayoutMismatch(f"{name!r}: boxes must be a list of at most {MAX_BOXES}")
    stored = tuple(_decode_box(name, shape, b) for b in boxes)
    return ShardLayout(name, dtype, shape, mesh, tuple(placements), stored)


def _decode_box(name: str, shape: tuple[int, ...], entry: object) -> Stored:
    if not isinstance(entry, dict) or not isinstance(entry.get("tensor"), str):
        raise LayoutMismatch(f"{name!r}: a box entry must be an object naming its tensor")
    offsets = _ints(name, "offsets", entry.get("offsets"))
    sizes = _ints(name, "sizes", entry.get("sizes"))
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise LayoutMismatch(f"{name!r}: box {offsets}+{sizes} does not have {len(shape)} dimensions")
    return Stored(Box(offsets, sizes), 0, entry["tensor"])


def _ints(name: str, what: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise LayoutMismatch(f"{name!r}: {what} must be a list of at most {MAX_DIMS} integers")
    if not all(type(v) is int and 0 <= v < 1 << 62 for v in value):
        raise LayoutMismatch(f"{name!r}: {what} must be non-negative integers, not {str(value)[:200]}")
    return tuple(value)
