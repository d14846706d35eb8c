"""GEN_GET_DELTA on the wire (docs/protocol.md §14, "Delta reads"): a read of generation ``at``
by a reader that holds generation ``base``, answered per chunk with a delta (wire/delta.py) or
the full chunk.

Request block: ``u64 at | u64 base | names``. Answer metadata: one uint8 record per name (its
delta bytes, in the data section in name order; version = the generation number), then
``u64 number | 16-byte digest | prefix`` (as GEN_GET), then ``u64 base used (0: none, every chunk
FULL) | u8 checksum kind | u32 chunk size``, the tensors' own records at ``number``, and per record
``u32 n`` and ``n`` x (``u32 delta length | u64 checksum of the new chunk``).

Every length here is the peer's: ``decode_answer`` checks them all against the records before a
byte of the data is used (one entry per chunk, each delta 1 .. chunk + 1 bytes long, the lengths
adding up to the tensor's uint8 record), so a lying answer is refused as a whole.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tensorwire.errors import ProtocolError
from tensorwire.types import TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import chunk_count

_REQUEST = struct.Struct("<QQ")  # at, base
_HEAD = struct.Struct("<QBI")  # base used, checksum kind, chunk size
_ENTRY = struct.Struct("<IQ")  # delta length, checksum of the new chunk


@dataclass(frozen=True, slots=True)
class TensorDelta:
    """One tensor of a delta answer: its record at the new generation, and per chunk the length of
    its delta in the data section and the new chunk's checksum."""

    meta: TensorMeta
    lengths: tuple[int, ...]
    checksums: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class DeltaAnswer:
    prefix: str
    number: int
    digest: bytes
    base: int  # the generation the deltas are against; 0: none (every chunk FULL)
    checksum_kind: int
    chunk_size: int
    tensors: tuple[TensorDelta, ...]


def encode_request(at: int, base: int, names: Sequence[str]) -> bytes:
    return _REQUEST.pack(at, base) + wm.encode_names(names)


def decode_request(reader: wm.MetaReader) -> tuple[int, int, list[str]]:
    at, base = reader.take(_REQUEST)
    return at, base, wm.decode_names(reader)


def encode_answer(answer: DeltaAnswer) -> bytes:
    """The whole metadata block, the uint8 records of the data section first."""
    number = answer.number
    sizes = [sum(t.lengths) for t in answer.tensors]
    data = [
        TensorMeta(t.meta.name, torch.uint8, (n,), n, number)
        for t, n in zip(answer.tensors, sizes, strict=True)
    ]
    parts = [
        wm.encode_records(data),
        wg.encode_read_answer(answer.prefix, number, answer.digest),
        _HEAD.pack(answer.base, answer.checksum_kind, answer.chunk_size),
        wm.encode_records([t.meta for t in answer.tensors]),
    ]
    for t in answer.tensors:
        parts.append(struct.pack("<I", len(t.lengths)))
        parts.append(b"".join(_ENTRY.pack(n, s) for n, s in zip(t.lengths, t.checksums, strict=True)))
    return b"".join(parts)


def decode_answer(reader: wm.MetaReader, data: Sequence[TensorMeta]) -> DeltaAnswer:
    """The block past its uint8 records (``data``, already read), every length checked."""
    prefix, number, digest = wg.decode_read_answer(reader)
    base, kind, chunk_size = reader.take(_HEAD)
    if kind not in set(ChecksumKind) or chunk_size < 1:
        raise ProtocolError(f"a delta answer with checksum kind {kind} and chunk size {chunk_size}")
    metas = wm.decode_records(reader)
    if [m.name for m in metas] != [m.name for m in data]:
        raise ProtocolError("a delta answer's records name other tensors than its data")
    tensors = tuple(
        _tensor(reader, meta, chunk_size, held.nbytes) for meta, held in zip(metas, data, strict=True)
    )
    return DeltaAnswer(prefix, number, digest, base, kind, chunk_size, tensors)


def _tensor(reader: wm.MetaReader, meta: TensorMeta, chunk_size: int, data_bytes: int) -> TensorDelta:
    n = reader.u32()
    if n != chunk_count(meta.nbytes, chunk_size) or _ENTRY.size * n > reader.remaining:
        raise ProtocolError(f"a delta answer gives {meta.name!r} {n} chunks, not one entry per chunk")
    flat = reader.take(struct.Struct("<" + "IQ" * n))
    lengths, sums = tuple(flat[0::2]), tuple(flat[1::2])
    for i, length in enumerate(lengths):
        full = min(chunk_size, meta.nbytes - i * chunk_size)
        if not 1 <= length <= full + 1:  # a delta is never longer than its FULL form
            raise ProtocolError(f"a delta of {length} bytes for chunk {i} of {meta.name!r} ({full} bytes)")
    if sum(lengths) != data_bytes:
        raise ProtocolError(f"the deltas of {meta.name!r} add up to {sum(lengths)} bytes, not {data_bytes}")
    return TensorDelta(meta, lengths, sums)


def max_data_bytes(nbytes: int) -> int:
    """The most delta bytes a tensor of ``nbytes`` may be answered with (its FULL form, in the
    smallest chunks a peer may claim): what a reader allocates at most before the lengths are read."""
    return 2 * nbytes
