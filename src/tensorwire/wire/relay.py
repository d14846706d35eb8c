"""The relay's metadata blocks (docs/protocol.md §15): RELAY_JOIN, RELAY_GET, RELAY_REPORT,
RELAY_STATS. Bytes in, bytes out; every count is checked against the receiver's ``Limits`` and
the bytes present (``MetaReader``).

A generation's chunks are numbered once across all its tensors: the tensors in name order, each
cut into ``chunk_bytes`` pieces (the last one shorter; an empty tensor has none). ``Manifest``
holds that layout and one checksum per chunk; ``locate`` maps a chunk number to its tensor.
"""

from __future__ import annotations

import bisect
import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from tensorwire.errors import LimitExceeded, ProtocolError
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_GET = struct.Struct("<QQII")  # generation, first chunk, max chunks, wait ms
_REPORT = struct.Struct("<QQBQ")  # generation, reader, what, upstream
_MAX_ADDRESS_BYTES = 300
_MAX_JSON_BYTES = 1 << 20


class Report(enum.IntEnum):
    """What a RELAY_REPORT says about its reader."""

    DONE = 1  # it holds every chunk: it stays an upstream for later readers
    FAILED = 2  # its upstream died, stalled or sent a corrupt chunk: route it around
    LEAVE = 3  # it no longer serves this generation


@dataclass(frozen=True, slots=True)
class Manifest:
    """One generation as the origin describes it: what a reader checks every chunk against."""

    generation: int
    chunk_bytes: int
    metas: tuple[TensorMeta, ...]
    checksums: tuple[int, ...]  # one per chunk, in chunk order
    kind: int = ChecksumKind.XXH3_64
    starts: tuple[int, ...] = field(default=(), compare=False)  # each tensor's first chunk number

    def __post_init__(self) -> None:
        starts, total = [], 0
        for meta in self.metas:
            starts.append(total)
            total += chunks_of(meta.nbytes, self.chunk_bytes)
        object.__setattr__(self, "starts", tuple(starts))
        if total != len(self.checksums):
            raise ProtocolError(f"a manifest of {total} chunks carries {len(self.checksums)} checksums")

    @property
    def chunks(self) -> int:
        return len(self.checksums)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    def locate(self, chunk: int) -> tuple[int, int, int]:
        """(tensor index, byte offset in it, chunks left in that tensor from ``chunk`` on)."""
        if not 0 <= chunk < self.chunks:
            raise ProtocolError(f"chunk {chunk} is not in a generation of {self.chunks} chunks")
        index = bisect.bisect_right(self.starts, chunk) - 1
        while chunks_of(self.metas[index].nbytes, self.chunk_bytes) == 0:  # empty tensors share a start
            index += 1
        within = chunk - self.starts[index]
        left = chunks_of(self.metas[index].nbytes, self.chunk_bytes) - within
        return index, within * self.chunk_bytes, left

    def span(self, chunk: int, count: int) -> tuple[int, int, int]:
        """(tensor index, byte offset, byte length) of ``count`` chunks from ``chunk`` on, all in
        one tensor (the caller clamps ``count`` to the chunks left in it)."""
        index, offset, left = self.locate(chunk)
        count = min(count, left)
        end = min(offset + count * self.chunk_bytes, self.metas[index].nbytes)
        return index, offset, end - offset


def chunks_of(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise LimitExceeded(f"a string of {len(raw)} bytes cannot be encoded (max 65535)")
    return _U16.pack(len(raw)) + raw


# -- RELAY_JOIN ---------------------------------------------------------------------------------
def encode_join(prefix: str, after: int, relay: str, session: int = 0) -> bytes:
    """A reader that holds generation ``after`` (0: none) of ``prefix`` and serves RELAY_GET at
    ``relay`` ("": it does not relay) asks for the newest generation and where to pull it from.
    ``session`` (0: none, and then not sent): the parameter-server session it relays a job's pulls
    for (a worker's incarnation), which admits it to the job's chains (§15.1)."""
    tail = _U64.pack(session) if session else b""
    return _text(prefix) + _U64.pack(after) + _text(relay) + tail


def decode_join(reader: wm.MetaReader) -> tuple[str, int, str, int]:
    """(prefix, after, relay address, session: 0 when the join carries none)."""
    prefix = reader.name()
    after = reader.u64()
    relay = reader.text(_MAX_ADDRESS_BYTES)
    session = reader.u64() if reader.remaining else 0
    reader.done()
    return prefix, after, relay, session


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the coordinator put a reader: its id in the relay (0: not in it) and its upstream
    (id 0 and address "": the origin itself, over the reader's own connection)."""

    reader: int
    upstream: int
    address: str


def encode_join_reply(manifest: Manifest, placement: Placement) -> bytes:
    head = _U64.pack(manifest.generation) + _encode_placement(placement)
    sums = _U32.pack(len(manifest.checksums)) + struct.pack(
        f"<{len(manifest.checksums)}Q", *manifest.checksums
    )
    body = _U64.pack(manifest.chunk_bytes) + _U8.pack(manifest.kind) + wm.encode_records(manifest.metas)
    return head + body + sums


def decode_join_reply(reader: wm.MetaReader, max_chunks: int) -> tuple[Manifest, Placement]:
    generation = reader.u64()
    placement = _decode_placement(reader)
    chunk_bytes = reader.u64()
    kind = reader.u8()
    metas = wm.decode_records(reader)
    (count,) = reader.take(_U32)
    if count > max_chunks:
        raise LimitExceeded(f"a manifest of {count} chunks exceeds {max_chunks}")
    checksums = reader.take(struct.Struct(f"<{count}Q"))
    reader.done()
    if chunk_bytes < 1:
        raise ProtocolError("a manifest with a chunk size of 0")
    return Manifest(generation, chunk_bytes, tuple(metas), tuple(checksums), kind), placement


def _encode_placement(placement: Placement) -> bytes:
    return _U64.pack(placement.reader) + _U64.pack(placement.upstream) + _text(placement.address)


def _decode_placement(reader: wm.MetaReader) -> Placement:
    return Placement(reader.u64(), reader.u64(), reader.text(_MAX_ADDRESS_BYTES))


# -- RELAY_GET ----------------------------------------------------------------------------------
def encode_get(prefix: str, generation: int, first: int, count: int, wait_ms: int) -> bytes:
    """Chunks ``first`` .. ``first + count`` of a generation (fewer: those of ``first``'s tensor
    the peer holds verified), waiting at most ``wait_ms`` for ``first``."""
    return _text(prefix) + _GET.pack(generation, first, count, wait_ms)


def decode_get(reader: wm.MetaReader) -> tuple[str, int, int, int, int]:
    prefix = reader.name()
    generation, first, count, wait_ms = reader.take(_GET)
    reader.done()
    if count < 1:
        raise ProtocolError("RELAY_GET asks for no chunks")
    return prefix, generation, first, count, wait_ms


# -- RELAY_REPORT -------------------------------------------------------------------------------
def encode_report(prefix: str, generation: int, reader_id: int, what: Report, upstream: int) -> bytes:
    return _text(prefix) + _REPORT.pack(generation, reader_id, int(what), upstream)


def decode_report(reader: wm.MetaReader) -> tuple[str, int, int, Report, int]:
    prefix = reader.name()
    generation, reader_id, what, upstream = reader.take(_REPORT)
    reader.done()
    try:
        report = Report(what)
    except ValueError as exc:
        raise ProtocolError(f"unknown RELAY_REPORT kind {what}") from exc
    return prefix, generation, reader_id, report, upstream


def encode_report_reply(placement: Placement) -> bytes:
    return _encode_placement(placement)


def decode_report_reply(reader: wm.MetaReader) -> Placement:
    placement = _decode_placement(reader)
    reader.done()
    return placement


# -- RELAY_STATS --------------------------------------------------------------------------------
def encode_stats(prefix: str) -> bytes:
    return _text(prefix)


def decode_stats(reader: wm.MetaReader) -> str:
    prefix = reader.name()
    reader.done()
    return prefix


def encode_json(doc: bytes) -> bytes:
    return _U32.pack(len(doc)) + doc


def decode_json(reader: wm.MetaReader) -> bytes:
    (n,) = reader.take(_U32)
    if n > _MAX_JSON_BYTES:
        raise LimitExceeded(f"a RELAY_STATS answer of {n} bytes exceeds {_MAX_JSON_BYTES}")
    raw = reader.raw(n)
    reader.done()
    return raw


def checksums_of(kind: int, buffers: Sequence[memoryview], chunk_bytes: int) -> tuple[int, ...]:
    """Every chunk's checksum, the buffers taken in order (each tensor's bytes, cut into chunks)."""
    return tuple(
        checksum(kind, buf[at : at + chunk_bytes])
        for buf in buffers
        for at in range(0, buf.nbytes, chunk_bytes)
    )
