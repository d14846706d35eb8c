"""A delta is untrusted input (wire/delta.py, docs/protocol.md §5.6): whatever a peer puts in one,
``apply`` raises CorruptFrame, writes nothing to ``out``, and holds no more than a few chunks'
worth of memory: truncated deltas, unknown kinds and codecs, lying counts, positions beyond the
chunk or named twice, element widths the chunk cannot hold, decompression bombs."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
import zstandard

from tensorwire.errors import CorruptFrame
from tensorwire.wire import delta
from tensorwire.wire.lossless import Codec

SIZE = 4096  # the chunk: 1024 elements of 4 bytes
ITEMS = SIZE // 4
SENTINEL = 0xA5
SPARSE_HEAD = struct.Struct("<BBBI")


def _sparse(gaps: list[int], width: int = 4, count: int | None = None, codec: int = Codec.RAW) -> bytes:
    """A SPARSE delta with these gaps (u32), XOR values of 1, raw or zstd body, and any count."""
    body = delta._transpose(np.array(gaps, dtype=np.uint32), 4)
    body += delta._transpose(np.ones(len(gaps), dtype=delta._UINT[width]), width)
    if codec == Codec.ZSTD:
        body = zstandard.ZstdCompressor().compress(body)
    return SPARSE_HEAD.pack(delta.Kind.SPARSE, codec, width, len(gaps) if count is None else count) + body


def _refused(bad: bytes | bytearray) -> None:
    """``bad`` is refused, and neither ``out`` nor (in place) the base is written."""
    base = bytes(range(256)) * (SIZE // 256)
    out = bytearray([SENTINEL]) * SIZE
    with pytest.raises(CorruptFrame):
        delta.apply(base, bad, out)
    assert out == bytearray([SENTINEL]) * SIZE
    held = bytearray(base)
    with pytest.raises(CorruptFrame):
        delta.apply(held, bad, held)
    assert held == base


def _valid() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    sparse = np.frombuffer(base, dtype=np.uint32).copy()
    sparse[::50] += 1
    dense = np.frombuffer(base, dtype=np.uint32) ^ np.uint32(1)
    return {
        "FULL": delta.encode(base, rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes(), 4),
        "SPARSE": delta.encode(base, sparse.tobytes(), 4),
        "XOR": delta.encode(base, dense.tobytes(), 4),
    }


@pytest.mark.parametrize("kind", ["FULL", "SPARSE", "XOR"])
def test_every_truncation_and_extension_is_refused(kind: str) -> None:
    good = _valid()[kind]
    assert delta.kind_of(good).name == kind
    for cut in sorted({0, 1, 2, 3, 6, len(good) // 2, len(good) - 1}):
        _refused(good[:cut])
    _refused(good + b"\x00")


def test_unknown_kinds_and_codecs_are_refused() -> None:
    _refused(b"\x07")
    _refused(bytes([delta.Kind.XOR, Codec.RAW, 4]) + bytes(SIZE))  # XOR is always compressed
    _refused(bytes([delta.Kind.XOR, 9, 4]) + bytes(16))
    _refused(_sparse([3])[:1] + b"\x09" + _sparse([3])[2:])


def test_widths_the_chunk_cannot_hold_are_refused() -> None:
    for width in (0, 3, 16):
        bad = bytearray(_sparse([3]))
        bad[2] = width
        _refused(bad)
    base, out = bytes(12), bytearray(12)  # 12 bytes are not 8-byte elements
    with pytest.raises(CorruptFrame):
        delta.apply(base, _sparse([0], width=8), out)
    xor = bytes([delta.Kind.XOR, Codec.ZSTD, 8]) + zstandard.ZstdCompressor().compress(bytes(12))
    with pytest.raises(CorruptFrame):
        delta.apply(base, xor, out)
    assert out == bytes(12)


def test_positions_beyond_the_chunk_are_refused() -> None:
    _refused(_sparse([ITEMS]))  # one past the last element
    _refused(_sparse([0] + [1] * (ITEMS - 1) + [1], count=ITEMS + 1))  # every element, then one more
    _refused(_sparse([ITEMS - 1, 2**32 - 1]))  # a gap that would wrap a 32-bit sum
    _refused(_sparse([5, 2**31, 2**31]))


def test_an_element_named_twice_is_refused() -> None:
    _refused(_sparse([5, 0]))
    _refused(_sparse([0, 7, 0, 1]))


def test_lying_counts_are_refused() -> None:
    _refused(_sparse([1, 2, 3], count=2))  # a raw body longer than its count
    _refused(_sparse([1, 2, 3], count=4))  # shorter
    _refused(_sparse([1, 2, 3], count=4, codec=Codec.ZSTD))  # decodes to fewer bytes than it claims
    _refused(_sparse([1, 2, 3], count=2**32 - 1, codec=Codec.ZSTD))


def _peak(bad: bytes, size: int) -> int:
    """The most memory ``apply`` held (bytes, traced) on ``bad`` for a chunk of ``size`` bytes."""
    base, out = bytes(size), bytearray(size)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptFrame):
            delta.apply(base, bad, out)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_count_beyond_the_chunk_is_refused_before_its_body_is_decoded() -> None:
    """A 64-byte chunk and a body of a million valid gaps: 8 MB decoded if the count were believed."""
    many = _sparse([0] + [1] * (1_000_000 - 1), codec=Codec.ZSTD)
    assert len(many) < 64 << 10
    assert _peak(many, 64) < 1 << 20


@pytest.mark.parametrize("kind", [delta.Kind.XOR, delta.Kind.SPARSE])
def test_decompression_bombs_decode_no_further_than_the_chunk(kind: delta.Kind) -> None:
    """A small zstd frame of 256 MiB of zeros, with and without its content size: the decoder
    stops at the chunk's size (SPARSE: its count's body, at most 5x the chunk)."""
    zeros = bytes(1 << 20)
    for size_known in (True, False):
        compressor = zstandard.ZstdCompressor(write_content_size=size_known)
        chunks = compressor.compressobj()
        bomb = b"".join(chunks.compress(zeros) for _ in range(256)) + chunks.flush()
        assert len(bomb) < 64 << 10
        xor_head = bytes([kind, Codec.ZSTD, 4])
        head = xor_head if kind == delta.Kind.XOR else SPARSE_HEAD.pack(kind, Codec.ZSTD, 4, 8)
        assert _peak(head + bomb, SIZE) < 1 << 20
