"""Generations on the wire (docs/protocol.md §14): the metadata blocks of GEN_PUBLISH, GEN_GET,
GEN_GET_RANGE, GEN_MANIFEST, GEN_WAIT, GEN_LEASE, GEN_DROP and GEN_PUBLISH_PART, and the root
digest of a generation.

Bytes in, bytes out: the server (server/generation_ops.py) and the client (client/generations.py)
share these, so the digest a reader recomputes is the one the server computed, by construction.

Root digest (16 bytes): BLAKE2b with a 16-byte digest over ``DIGEST_DOMAIN``, then ``u8 checksum
kind | u32 chunk size | u32 tensor count``, then for each tensor in name order (code point order,
which is UTF-8 byte order) its record as in §6 with version 0 (name, dtype code, ndim, shape,
nbytes, 0), ``u32 chunk count`` and each chunk's checksum as ``u64``. Chunk i of a tensor is its
bytes ``i * chunk_size .. min((i + 1) * chunk_size, nbytes)``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tensorwire.errors import InvalidName, InvalidTensor, ProtocolError
from tensorwire.types import ChunkSums, Generation, GenerationManifest, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import Buffer, ChecksumKind, checksum
from tensorwire.wire.frame import chunk_count

DIGEST_BYTES = 16
DIGEST_DOMAIN = b"tensorwire generation v1\x00"
CHUNK_BYTES = 4 << 20  # the chunk size of every generation's checksums (the manifest says it)
CHECKSUM_KIND = ChecksumKind.XXH3_64
LATEST = 0  # ``at`` on the wire: the newest generation

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_DIGEST_HEAD = struct.Struct("<BII")
_GEN = struct.Struct(f"<Q{DIGEST_BYTES}sQ")  # number, digest, nbytes
_WAIT = struct.Struct("<QI")  # after, timeout in ms
_LEASE = struct.Struct("<QI")  # number, ms (0: release)
_LEASED = struct.Struct("<IQ")  # ms granted, oldest kept
TXN_BYTES = 16  # a GEN_PUBLISH_PART transaction id
_PART = struct.Struct(f"<{TXN_BYTES}sIII")  # txn, part index, part count, timeout in ms
_SUMS_HEAD = struct.Struct("<BI")  # checksum kind, chunk size


def chunk_checksums(
    data: Buffer, chunk_size: int = CHUNK_BYTES, kind: int = CHECKSUM_KIND
) -> tuple[int, ...]:
    """The checksum of each ``chunk_size`` bytes of ``data``, in order."""
    view = memoryview(data).cast("B")
    return tuple(checksum(kind, view[i : i + chunk_size]) for i in range(0, view.nbytes, chunk_size))


def root_digest(tensors: Iterable[ChunkSums], chunk_size: int, kind: int) -> bytes:
    """The root digest over ``tensors`` (any order: they are hashed in name order)."""
    ordered = sorted(tensors, key=lambda t: t.meta.name)
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(DIGEST_DOMAIN)
    h.update(_DIGEST_HEAD.pack(kind, chunk_size, len(ordered)))
    for entry in ordered:
        meta = entry.meta
        if len(entry.checksums) != chunk_count(meta.nbytes, chunk_size):
            raise ProtocolError(
                f"{meta.name!r} has {len(entry.checksums)} chunk checksums, not one per chunk"
            )
        h.update(wm.encode_record(meta.with_version(0)))
        h.update(_U32.pack(len(entry.checksums)))
        h.update(struct.pack(f"<{len(entry.checksums)}Q", *entry.checksums))
    return h.digest()


# -- blocks ---------------------------------------------------------------------------------------
def encode_prefix(prefix: str) -> bytes:
    """What every part of a GEN_PUBLISH starts with (records follow), and GEN_MANIFEST's start."""
    return wm.encode_names([prefix])[4:]  # one length-prefixed string


def decode_prefix(reader: wm.MetaReader) -> str:
    return reader.name()


def encode_generation(gen: Generation) -> bytes:
    """``prefix | u64 number | 16-byte digest | u64 nbytes | names``."""
    return (
        encode_prefix(gen.prefix) + _GEN.pack(gen.number, gen.digest, gen.nbytes) + wm.encode_names(gen.names)
    )


def decode_generation(reader: wm.MetaReader) -> Generation:
    prefix = decode_prefix(reader)
    number, digest, nbytes = reader.take(_GEN)
    return Generation(prefix, number, bytes(digest), tuple(wm.decode_names(reader)), nbytes)


def encode_get(at: int, names: Sequence[str]) -> bytes:
    """GEN_GET's block: ``u64 at (0: latest) | names``."""
    return _U64.pack(at) + wm.encode_names(names)


def decode_get(reader: wm.MetaReader) -> tuple[int, list[str]]:
    at = reader.u64()
    return at, wm.decode_names(reader)


def encode_read_answer(prefix: str, number: int, digest: bytes) -> bytes:
    """What follows the records of a GEN_GET answer: ``u64 number | 16-byte digest | prefix``."""
    return _U64.pack(number) + digest + encode_prefix(prefix)


def decode_read_answer(reader: wm.MetaReader) -> tuple[str, int, bytes]:
    """``(prefix, number, digest)`` of the generation a GEN_GET read."""
    number = reader.u64()
    digest = reader.raw(DIGEST_BYTES)
    return decode_prefix(reader), number, digest


def encode_manifest_request(prefix: str, at: int) -> bytes:
    """GEN_MANIFEST's block: ``prefix | u64 at``."""
    return encode_prefix(prefix) + _U64.pack(at)


def decode_manifest_request(reader: wm.MetaReader) -> tuple[str, int]:
    return decode_prefix(reader), reader.u64()


def encode_manifest(manifest: GenerationManifest) -> bytes:
    """``generation | u8 kind | u32 chunk size | records | per record: u32 count, count x u64``."""
    parts = [
        encode_generation(manifest.generation),
        _SUMS_HEAD.pack(manifest.checksum_kind, manifest.chunk_size),
        wm.encode_records([t.meta for t in manifest.tensors]),
    ]
    for entry in manifest.tensors:
        parts.append(_U32.pack(len(entry.checksums)))
        parts.append(struct.pack(f"<{len(entry.checksums)}Q", *entry.checksums))
    return b"".join(parts)


def decode_manifest(reader: wm.MetaReader) -> GenerationManifest:
    """A manifest, every count checked: one checksum per chunk of each tensor, no more."""
    gen = decode_generation(reader)
    kind, chunk_size = reader.take(_SUMS_HEAD)
    if kind not in set(ChecksumKind) or chunk_size < 1:
        raise ProtocolError(f"a manifest with checksum kind {kind} and chunk size {chunk_size}")
    metas = wm.decode_records(reader)
    tensors = []
    for meta in metas:
        n = reader.u32()
        if n != chunk_count(meta.nbytes, chunk_size) or 8 * n > reader.remaining:
            raise ProtocolError(f"the manifest gives {meta.name!r} {n} chunk checksums, not one per chunk")
        tensors.append(ChunkSums(meta, reader.take(struct.Struct(f"<{n}Q"))))
    return GenerationManifest(gen, chunk_size, kind, tuple(tensors))


def encode_wait(prefix: str, after: int, timeout_ms: int) -> bytes:
    """GEN_WAIT's block: ``prefix | u64 after | u32 timeout in ms``."""
    return encode_prefix(prefix) + _WAIT.pack(after, timeout_ms)


def decode_wait(reader: wm.MetaReader) -> tuple[str, int, int]:
    prefix = decode_prefix(reader)
    after, timeout_ms = reader.take(_WAIT)
    return prefix, after, timeout_ms


def encode_lease(prefix: str, number: int, ms: int) -> bytes:
    """GEN_LEASE's block: ``prefix | u64 number | u32 ms (0: release)``."""
    return encode_prefix(prefix) + _LEASE.pack(number, ms)


def decode_lease(reader: wm.MetaReader) -> tuple[str, int, int]:
    prefix = decode_prefix(reader)
    number, ms = reader.take(_LEASE)
    return prefix, number, ms


def encode_leased(ms: int, oldest: int) -> bytes:
    """GEN_LEASE's answer: ``u32 ms granted | u64 oldest generation kept``."""
    return _LEASED.pack(ms, oldest)


def encode_dropped(count: int) -> bytes:
    """GEN_DROP's answer (its request is ``prefix``): ``u64 generations dropped``."""
    return _U64.pack(count)


def decode_dropped(reader: wm.MetaReader) -> int:
    return reader.u64()


@dataclass(frozen=True, slots=True)
class PartHead:
    """What every frame of a GEN_PUBLISH_PART starts with: which transaction, which of its parts."""

    prefix: str
    txn: bytes  # TXN_BYTES, chosen by the job (rank 0) and shared by all its parts
    index: int  # 0 .. count - 1
    count: int  # parts in the transaction
    timeout_ms: int  # how long the server waits for the others (it caps this)


def encode_part_head(head: PartHead) -> bytes:
    """GEN_PUBLISH_PART's block start: ``prefix | 16-byte txn | u32 index | u32 count | u32 timeout
    in ms`` (records follow, as in GEN_PUBLISH)."""
    if len(head.txn) != TXN_BYTES:
        raise InvalidTensor(f"a transaction id is {TXN_BYTES} bytes, not {len(head.txn)}")
    return encode_prefix(head.prefix) + _PART.pack(head.txn, head.index, head.count, head.timeout_ms)


def decode_part_head(reader: wm.MetaReader) -> PartHead:
    prefix = decode_prefix(reader)
    txn, index, count, timeout_ms = reader.take(_PART)
    if not count or index >= count:
        raise ProtocolError(f"part {index} of {count} is no part of a transaction")
    return PartHead(prefix, bytes(txn), index, count, timeout_ms)


def encode_shm_part(head: PartHead, put_id: int, sums: Sequence[Sequence[int]]) -> bytes:
    """SHM_GEN_PART's block start: the part head, ``u64 put id``, then for each record of the put
    (in its order) its chunk checksums as ``u64`` (``chunk_count`` of them: the count follows from
    the record); the inline tensors' records follow, as in SHM_COMMIT."""
    flat = [s for per in sums for s in per]
    return encode_part_head(head) + _U64.pack(put_id) + struct.pack(f"<{len(flat)}Q", *flat)


def decode_shm_part(reader: wm.MetaReader) -> tuple[PartHead, int]:
    """SHM_GEN_PART's head and put id (its checksums follow: ``decode_part_sums``)."""
    return decode_part_head(reader), reader.u64()


def decode_part_sums(reader: wm.MetaReader, sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """The chunk checksums of tensors of ``sizes`` bytes (the put's records, already bounded by
    the capacity that reserved them), in order."""
    out = []
    for nbytes in sizes:
        n = -(-nbytes // CHUNK_BYTES)
        out.append(tuple(reader.u64() for _ in range(n)))
    return out


MAX_RANGES = 65536  # ranges in one GEN_GET_RANGES
_RANGE = struct.Struct("<QQ")  # offset, length


def encode_get_ranges(at: int, ranges: Sequence[tuple[int, int]], name: str) -> bytes:
    """GEN_GET_RANGES's block: ``u64 at | u32 count | count x (u64 offset, u64 length) | names``
    (exactly one name)."""
    return (
        _U64.pack(at) + _U32.pack(len(ranges)) + b"".join(_RANGE.pack(o, n) for o, n in ranges)
        + wm.encode_names([name])
    )  # fmt: skip


def decode_get_ranges(reader: wm.MetaReader) -> tuple[int, list[tuple[int, int]], list[str]]:
    """The block of a GEN_GET_RANGES; ProtocolError past ``MAX_RANGES`` (before they are read)."""
    at = reader.u64()
    count = reader.u32()
    if not count or count > MAX_RANGES:
        raise ProtocolError(f"a GEN_GET_RANGES of {count} ranges: 1 to {MAX_RANGES}")
    ranges = [(o, n) for o, n in (reader.take(_RANGE) for _ in range(count))]
    return at, ranges, wm.decode_names(reader)


def decode_leased(reader: wm.MetaReader) -> tuple[int, int]:
    ms, oldest = reader.take(_LEASED)
    return ms, oldest


def check_range(meta: TensorMeta, offset: int, length: int) -> None:
    """InvalidTensor unless ``offset .. offset + length`` lies inside ``meta``'s bytes."""
    if offset + length > meta.nbytes:
        raise InvalidTensor(f"bytes {offset}..{offset + length} are not inside {meta.name!r}")


def check_names(prefix: str, names: Sequence[str]) -> None:
    """InvalidName unless every name is ``prefix/key`` (the names themselves are checked by the
    store's reservation)."""
    head = prefix + "/"
    for name in names:
        if not name.startswith(head):
            raise InvalidName(f"{name!r} is not under the prefix {prefix!r} it is published to")
