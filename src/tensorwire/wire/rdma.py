"""The metadata blocks of the RDMA_* opcodes (docs/protocol.md §17) and the chunk checksums that
cover bytes moved one-sided. Bytes in, bytes out; no engine here.

The control messages carry names, records, the engine addresses of buffers the server registered
for one request, and the checksum of every chunk of each such buffer; the bytes themselves move
through the transfer engine. Tensors under the server's inline limit travel in the frames instead,
checksummed like any frame.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import NamedTuple

from tensorwire.errors import ProtocolError
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import checksum

MAX_SESSION_BYTES = 255  # an engine session id: "host:port"
PROTOCOLS = ("rdma", "tcp")  # what an engine moves bytes with (TENSORWIRE_RDMA_PROTOCOL)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class End(enum.IntEnum):
    """What an RDMA_END does with the reservation it names."""

    RELEASE = 0  # a get's buffers, or a put given up: unregistered and freed, nothing stored
    COMMIT = 1  # a put: verify every chunk, then store


class Attach(NamedTuple):
    """An RDMA_ATTACH answer: where the server's engine listens, what it moves bytes with, the
    largest tensor that travels inline rather than through the engine, and the engine's instance:
    a random number that tells this engine from an earlier one that listened on the same port."""

    session: str
    protocol: str
    inline_max: int
    instance: int


class BufferRef(NamedTuple):
    """One tensor of an RDMA_PUT or RDMA_GET answer that moves through the engine: the index of its
    record or name in the request, its record, the address of the buffer the server registered for
    it, and (gets only) the checksum of each chunk of its bytes."""

    item: int
    meta: TensorMeta
    address: int
    checksums: tuple[int, ...] = ()


def chunk_checksums(kind: int, data: memoryview, chunk: int) -> tuple[int, ...]:
    """The checksum of each ``chunk``-byte piece of ``data`` (the last may be shorter)."""
    return tuple(checksum(kind, data[i : i + chunk]) for i in range(0, data.nbytes, chunk))


def chunk_count(nbytes: int, chunk: int) -> int:
    return -(-nbytes // chunk)


def bad_chunk(kind: int, data: memoryview, chunk: int, expected: Sequence[int]) -> int | None:
    """The index of the first chunk of ``data`` whose checksum is not ``expected``'s, or None."""
    if len(expected) != chunk_count(data.nbytes, chunk):
        return 0
    for index, want in enumerate(expected):
        if checksum(kind, data[index * chunk : (index + 1) * chunk]) != want:
            return index
    return None


# -- RDMA_ATTACH ---------------------------------------------------------------------------------
def encode_attach_request(protocol: str) -> bytes:
    return wm.encode_names([protocol])[4:]


def decode_attach_request(reader: wm.MetaReader) -> str:
    protocol = reader.text(16)
    reader.done()
    if protocol not in PROTOCOLS:
        raise ProtocolError(f"RDMA_ATTACH names protocol {protocol!r}; known: {', '.join(PROTOCOLS)}")
    return protocol


def encode_attach_answer(answer: Attach) -> bytes:
    names = wm.encode_names([answer.session, answer.protocol])[4:]
    return names + _U64.pack(answer.inline_max) + _U64.pack(answer.instance)


def decode_attach_answer(reader: wm.MetaReader) -> Attach:
    session, protocol = reader.text(MAX_SESSION_BYTES), reader.text(16)
    inline_max, instance = reader.u64(), reader.u64()
    reader.done()
    host, _, port = session.rpartition(":")
    if not host or not port.isdigit():
        raise ProtocolError(f"RDMA_ATTACH answered engine session {session!r}, not host:port")
    return Attach(session, protocol, inline_max, instance)


# -- RDMA_PUT / RDMA_GET -------------------------------------------------------------------------
def encode_get_request(chunk: int, names: Sequence[str]) -> bytes:
    return _U32.pack(chunk) + wm.encode_names(names)


def decode_get_request(reader: wm.MetaReader) -> tuple[int, list[str]]:
    chunk = reader.u32()
    names = wm.decode_names(reader)
    reader.done()
    return chunk, names


def encode_refs(refs: Sequence[BufferRef], with_checksums: bool) -> bytes:
    parts = [_U32.pack(len(refs))]
    for ref in refs:
        parts += [_U32.pack(ref.item), wm.encode_record(ref.meta), _U64.pack(ref.address)]
        if with_checksums:
            parts += [_U32.pack(len(ref.checksums)), *map(_U64.pack, ref.checksums)]
    return b"".join(parts)


def decode_refs(reader: wm.MetaReader, count_of: int, chunk: int = 0) -> list[BufferRef]:
    """Buffer references; each index points into a request of ``count_of`` items, once; with a
    ``chunk`` size, each carries exactly one checksum per chunk of its tensor."""
    refs: list[BufferRef] = []
    seen: set[int] = set()
    for _ in range(reader.count()):
        index, meta, address = reader.u32(), reader.record(), reader.u64()
        if index >= count_of or index in seen or not address or not meta.nbytes:
            raise ProtocolError(f"buffer reference to item {index} of {count_of} (address {address:#x})")
        seen.add(index)
        sums: tuple[int, ...] = ()
        if chunk:
            if reader.count() != chunk_count(meta.nbytes, chunk):
                raise ProtocolError(f"the checksums of {meta.name!r} do not cover its chunks one each")
            sums = tuple(reader.u64() for _ in range(chunk_count(meta.nbytes, chunk)))
        refs.append(BufferRef(index, meta, address, sums))
    return refs


# -- RDMA_END ------------------------------------------------------------------------------------
def encode_end(
    reservation: int,
    action: End,
    chunk: int = 0,
    checksums: Sequence[Sequence[int]] = (),
    inline: Sequence[TensorMeta] = (),
) -> bytes:
    """``u64 reservation | u8 action``; a commit adds ``u32 chunk``, the checksums of each buffer
    the put's answer named (in its order) and the records of the tensors sent inline."""
    head = _U64.pack(reservation) + bytes([action])
    if action is End.RELEASE:
        return head
    sums = [_U32.pack(len(checksums))]
    for each in checksums:
        sums += [_U32.pack(len(each)), *map(_U64.pack, each)]
    return head + _U32.pack(chunk) + b"".join(sums) + wm.encode_records(inline)


class Commit(NamedTuple):
    chunk: int
    checksums: list[tuple[int, ...]]
    inline: list[TensorMeta]


def decode_end(reader: wm.MetaReader) -> tuple[int, End, Commit | None]:
    reservation = reader.u64()
    try:
        action = End(reader.u8())
    except ValueError as exc:
        raise ProtocolError("RDMA_END with an unknown action") from exc
    if action is End.RELEASE:
        reader.done()
        return reservation, action, None
    chunk = reader.u32()
    checksums = [tuple(reader.u64() for _ in range(reader.count())) for _ in range(reader.count())]
    inline = wm.decode_records(reader)
    reader.done()
    return reservation, action, Commit(chunk, checksums, inline)


def encode_u64(value: int) -> bytes:
    return _U64.pack(value)
