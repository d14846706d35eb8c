"""Deltas between two versions of one chunk (docs/protocol.md §5.6): bytes in, bytes out, no sockets.

A reader that holds a chunk at generation g and wants it at g' can be sent, instead of the chunk,
what changed between the two. ``encode(base, new, itemsize)`` writes one self-describing delta,
the smallest of these kinds:

- ``FULL``: the new bytes as they are (always possible; chosen when nothing else is smaller, or
  when base and new differ in length).
- ``SPARSE``: the positions of the changed elements (u32 gaps) and the XOR of their old and new
  values, each byte-transposed (all first bytes, then all second bytes, ...), then zstd. This is
  what wins when few elements change: at 1% of the elements (random positions) it is 0.8-1.4% of
  the chunk, fp32 or bf16. XOR values rather than new values because a small change leaves sign, exponent and
  high mantissa bits alone: those bytes become zero planes that zstd squeezes to nothing.
- ``XOR``: base XOR new for the whole chunk, byte-transposed, then zstd (lz4 decoded too). Tried
  when most elements change, by a little (every weight after an optimizer step).

``apply(base, delta, out)`` rebuilds the new chunk in ``out``, which may be ``base`` itself (in
place; every kind allows it) or memory disjoint from it. A delta is untrusted input: every size,
count and position in it is checked against the chunk before the first byte of ``out`` is
written, decoded sizes are bounded by the chunk's, and a bad delta raises ``CorruptFrame``.
``apply_checked`` also compares the result's checksum with the new chunk's, and on a mismatch
leaves ``base`` as it was, even in place, so that the reader still holds generation g.

The caller keeps the base (the chunk at the generation it holds) and the new chunk's checksum
(sent with the delta, as for any chunk); a reader that no longer has the base asks for the full
chunk, which is what a reader with nothing gets anyway.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator

import numpy as np

from tensorwire.errors import CorruptFrame
from tensorwire.wire import checksum as ck
from tensorwire.wire import lossless
from tensorwire.wire.lossless import Codec

Buffer = bytes | bytearray | memoryview

U32_MAX = (1 << 32) - 1
# Which kinds are tried, by the share of elements that changed. Measured (fp32, bf16; random
# positions; small and random changes): SPARSE was never larger than XOR at any share, but XOR
# builds no position array, so it is quicker where most elements change; both are tried between.
SPARSE_MAX_DENSITY = 0.5
XOR_MIN_DENSITY = 0.25


class Kind(enum.IntEnum):
    """The first byte of a delta."""

    FULL = 0
    XOR = 1
    SPARSE = 2


# FULL: kind | the new bytes. The codecs are lossless.Codec's; an encoder here writes zstd (raw for
# a SPARSE body that zstd does not shrink), a decoder takes lz4 as well.
_XOR_HEAD = struct.Struct("<BBB")  # kind, codec (lz4/zstd), width; then the compressed planes
_SPARSE_HEAD = struct.Struct("<BBBI")  # kind, codec (raw/lz4/zstd), width, count; then the body
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def encode(base: Buffer, new: Buffer, itemsize: int, *, limit: int | None = None) -> bytes:
    """The smallest delta that turns ``base`` into ``new`` (one chunk of a tensor whose elements are
    ``itemsize`` bytes). A delta kind other than FULL is used only when it is smaller than both
    the chunk and ``limit`` (bytes; e.g. to insist on a 10% saving)."""
    chosen = encode_smaller(base, new, itemsize, limit=limit)
    return chosen if chosen is not None else bytes([Kind.FULL]) + bytes(new)


def encode_smaller(base: Buffer, new: Buffer, itemsize: int, *, limit: int | None = None) -> bytes | None:
    """``encode``'s delta when a kind other than FULL wins, else None: a sender that has the chunk
    in memory sends the FULL form from there (a kind byte, then the chunk) instead of a copy."""
    new_b = np.frombuffer(new, dtype=np.uint8)
    base_b = np.frombuffer(base, dtype=np.uint8)
    size = new_b.nbytes
    best = size if limit is None else min(limit, size)
    chosen: bytes | None = None
    if base_b.nbytes == size and size:
        for candidate in _candidates(base_b, new_b, _width(itemsize, size)):
            if len(candidate) < best:
                best, chosen = len(candidate), candidate
    return chosen


def _width(itemsize: int, size: int) -> int:
    """The element width the codec works in: the largest of 8, 4, 2, 1 that divides both the item
    size and the chunk (complex128 works in 8-byte halves; a ragged chunk in bytes)."""
    if itemsize < 1:
        raise ValueError(f"itemsize must be positive, not {itemsize}")
    return next(w for w in (8, 4, 2, 1) if itemsize % w == 0 and size % w == 0)


def _candidates(base_b: np.ndarray, new_b: np.ndarray, width: int) -> Iterator[bytes]:
    old, new = base_b.view(_UINT[width]), new_b.view(_UINT[width])
    changed = np.flatnonzero(old != new)
    density = changed.size / old.size
    if density <= SPARSE_MAX_DENSITY and old.size <= U32_MAX:
        yield _sparse(old, new, changed, width)
    if density >= XOR_MIN_DENSITY:
        # zstd only: lz4 was larger on every measured case (its decoder is kept for other encoders)
        planes = _transpose(np.bitwise_xor(old, new), width)
        yield _XOR_HEAD.pack(Kind.XOR, Codec.ZSTD, width) + lossless.compress(Codec.ZSTD, planes)


def _sparse(old: np.ndarray, new: np.ndarray, changed: np.ndarray, width: int) -> bytes:
    gaps = np.diff(changed, prepend=0).astype(np.uint32)  # the first "gap" is the first position
    xor = np.bitwise_xor(old[changed], new[changed])
    body = _transpose(gaps, 4) + _transpose(xor, width)
    packed = lossless.compress(Codec.ZSTD, body)
    codec, payload = (Codec.ZSTD, packed) if len(packed) < len(body) else (Codec.RAW, body)
    return _SPARSE_HEAD.pack(Kind.SPARSE, codec, width, changed.size) + payload


def _transpose(values: np.ndarray, width: int) -> bytes:
    """``values`` (n items of ``width`` bytes) as ``width`` planes: every item's byte 0, then byte 1..."""
    return values.view(np.uint8).reshape(-1, width).T.tobytes()


def _untranspose(planes: np.ndarray, width: int) -> np.ndarray:
    """The inverse of ``_transpose``: n items of ``width`` bytes from their planes."""
    return np.ascontiguousarray(planes.reshape(width, -1).T).view(_UINT[width]).reshape(-1)


def kind_of(delta: Buffer) -> Kind:
    """The kind a delta says it is; CorruptFrame for an empty delta or an unknown kind."""
    if not len(delta):
        raise CorruptFrame("an empty delta")
    try:
        return Kind(delta[0])
    except ValueError as exc:
        raise CorruptFrame(f"unknown delta kind {delta[0]}") from exc


def apply(base: Buffer, delta: Buffer, out: Buffer) -> None:
    """Rebuild the new chunk from ``base`` and ``delta`` into ``out`` (writable, the chunk's size;
    it may be ``base`` itself). FULL does not read ``base``. Every field of the delta is checked
    before anything is written: a malformed one raises CorruptFrame and leaves ``out`` untouched."""
    target = np.frombuffer(out, dtype=np.uint8)
    if not target.flags.writeable:
        raise ValueError("out must be writable")
    view = memoryview(delta)
    kind = kind_of(view)
    if kind == Kind.FULL:
        _apply_full(view, target)
        return
    source = np.frombuffer(base, dtype=np.uint8)
    _check_base(source, target)
    if kind == Kind.XOR:
        _apply_xor(source, view, target)
    else:
        _apply_sparse(source, view, target)


def _check_base(source: np.ndarray, target: np.ndarray) -> None:
    """``base`` and ``out`` are the caller's: the same size, and the same memory or disjoint."""
    if source.nbytes != target.nbytes:
        raise ValueError(f"base has {source.nbytes} bytes but out {target.nbytes}")
    if not _same_memory(source, target) and np.shares_memory(source, target):
        raise ValueError("out overlaps base without being base")


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return a.nbytes == 0 or a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


def _apply_full(view: memoryview, target: np.ndarray) -> None:
    if view.nbytes - 1 != target.nbytes:
        raise CorruptFrame(f"a FULL delta of {view.nbytes - 1} bytes for a chunk of {target.nbytes}")
    target[:] = np.frombuffer(view, dtype=np.uint8, offset=1)


def _apply_xor(source: np.ndarray, view: memoryview, target: np.ndarray) -> None:
    _, codec, width = _unpack(_XOR_HEAD, view)
    width = _check_width(width, target.nbytes)
    # decompress refuses codec 0 (raw) and any unknown one, and never decodes past the chunk's size
    planes = lossless.decompress(codec, view[_XOR_HEAD.size :], target.nbytes)
    xor = _untranspose(np.frombuffer(planes, dtype=np.uint8), width)
    np.bitwise_xor(source.view(_UINT[width]), xor, out=target.view(_UINT[width]))


def _apply_sparse(source: np.ndarray, view: memoryview, target: np.ndarray) -> None:
    _, codec, width, count = _unpack(_SPARSE_HEAD, view)
    width = _check_width(width, target.nbytes)
    items = target.nbytes // width
    if count > items:
        raise CorruptFrame(f"a SPARSE delta of {count} changes for a chunk of {items} elements")
    body = _sparse_body(codec, view[_SPARSE_HEAD.size :], count * (4 + width))
    positions = _positions(body[: 4 * count], items)
    xor = _untranspose(body[4 * count :], width)
    dest = target.view(_UINT[width])
    if not _same_memory(source, target):
        dest[:] = source.view(_UINT[width])
    dest[positions] ^= xor


def _sparse_body(codec: int, payload: memoryview, size: int) -> np.ndarray:
    """The decoded body, exactly ``size`` bytes (at most 5x the chunk, as count <= elements)."""
    if codec == Codec.RAW:
        if payload.nbytes != size:
            raise CorruptFrame(f"a raw SPARSE body of {payload.nbytes} bytes, not {size}")
        return np.frombuffer(payload, dtype=np.uint8)
    return np.frombuffer(lossless.decompress(codec, payload, size), dtype=np.uint8)


def _positions(planes: np.ndarray, items: int) -> np.ndarray:
    """Element positions from their gaps: strictly increasing and inside the chunk, else CorruptFrame."""
    gaps = _untranspose(planes, 4).astype(np.int64)
    if gaps.size and (gaps[1:] == 0).any():
        raise CorruptFrame("a SPARSE delta names an element twice")
    positions = np.cumsum(gaps)  # at most 2**32 items of at most 2**32: no overflow in int64
    if positions.size and positions[-1] >= items:
        raise CorruptFrame(f"a SPARSE delta names element {positions[-1]} of a chunk of {items}")
    return positions


def _unpack(head: struct.Struct, view: memoryview) -> tuple[int, ...]:
    if view.nbytes < head.size:
        raise CorruptFrame(f"a delta of {view.nbytes} bytes, shorter than its {head.size}-byte head")
    return head.unpack_from(view)


def _check_width(width: int, size: int) -> int:
    if width not in _UINT or size % width:
        raise CorruptFrame(f"a delta in {width}-byte elements for a chunk of {size} bytes")
    return width


def apply_checked(base: Buffer, delta: Buffer, out: Buffer, checksum_kind: int, expected: int) -> None:
    """``apply``, then the result's checksum against the new chunk's ``expected`` one: CorruptFrame
    on a mismatch (a resend, or the full chunk, can help). ``base`` is left as it was when this
    raises, also in place: a FULL delta is checked before it is copied, and an XOR or SPARSE one
    applied in place is applied a second time, which undoes it."""
    view = memoryview(delta)
    if kind_of(view) == Kind.FULL and ck.checksum(checksum_kind, view[1:]) != expected:
        raise CorruptFrame("a FULL delta does not match the new chunk's checksum")
    apply(base, view, out)
    if ck.checksum(checksum_kind, out) == expected:
        return
    target = np.frombuffer(out, dtype=np.uint8)
    if _same_memory(np.frombuffer(base, dtype=np.uint8), target):
        apply(base, view, out)  # XOR is its own inverse: base is back
    raise CorruptFrame("a chunk rebuilt from a delta does not match the new chunk's checksum")
