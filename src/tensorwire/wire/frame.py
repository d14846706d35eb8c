"""The fixed 40-byte frame header (docs/protocol.md, "Frame").

Every message, request or response, is ``header | metadata block | data section``. The header is
the only part read before the receiver knows how much more to read, so every length in it is
checked against the receiver's ``Limits`` before a byte of the rest is allocated, and a CRC32C over
the header and the metadata block catches a damaged length before it is trusted.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from tensorwire.errors import CorruptFrame, LimitExceeded, ProtocolError, UnsupportedVersion
from tensorwire.types import Limits
from tensorwire.wire.checksum import ChecksumKind, header_crc

MAGIC = b"TWIR"
PROTOCOL_VERSIONS = (1,)  # versions this build speaks, oldest first
TRAILER_BYTES = 8  # one little-endian u64 checksum after every data chunk
DEFAULT_CHUNK_BYTES = 4 << 20

_HEADER = struct.Struct("<4sBBBBQIIQI4x")
HEADER_BYTES = _HEADER.size  # 40
_CRC_COVERS = 32  # the header's bytes before header_crc


class Opcode(enum.IntEnum):
    HELLO = 1
    PING = 2
    PUT = 3
    GET = 4
    DELETE = 5
    LIST = 6
    STAT = 7
    PUT_MANY = 8
    GET_MANY = 9
    # The parameter server (wire/ps.py; served by servers with the tensorwire.ps extension).
    PS_INIT = 10
    PS_JOIN = 11
    PS_LEAVE = 12
    PS_PUSH = 13
    PS_PULL = 14
    PS_STATS = 15
    ALLREDUCE = 16
    PS_HEARTBEAT = 17
    PS_ROLLBACK = 18
    PS_REPLICATE = 19
    PUT_RESUMABLE = 20  # a put that survives a broken connection (docs/protocol.md §11.6)
    DIGEST = 21  # checksums of stored tensors (tensorwire.dataset.digest; docs/protocol.md §11.8)
    STATUS = 22  # the server's state as JSON: addresses, store, metrics endpoint, extensions (§11.9)
    PS_BARRIER = 23  # every live worker of a job reached the same point (§13.2)
    # Striping (§11.7): one tensor over several connections, published by one commit.
    PUT_RANGE = 24
    PUT_COMMIT = 25
    GET_RANGE = 26
    PS_END = 27  # end a parameter-server job, freeing its state (`tensorwire ps end`, §13.2)
    PS_RELAY = 28  # publish a job's parameters for a pull through the relay (§13.2)
    # Same-host shared memory (shm://, docs/protocol.md §12; served by server/shm.py).
    SHM_ATTACH = 32
    SHM_GET = 33
    SHM_PUT = 34
    SHM_COMMIT = 35
    SHM_RELEASE = 36
    # Generations (docs/protocol.md §14; served by server/generation_ops.py).
    GEN_PUBLISH = 40
    GEN_GET = 41
    GEN_GET_RANGE = 42
    GEN_MANIFEST = 43
    GEN_WAIT = 44
    GEN_LEASE = 45
    GEN_GET_DELTA = 46
    GEN_DROP = 47  # every generation of a prefix, and the prefix (docs/protocol.md §14)
    # The relay (docs/protocol.md §15; tensorwire.broadcast): readers of one generation feed each other.
    RELAY_JOIN = 48
    RELAY_GET = 49
    RELAY_REPORT = 50
    RELAY_STATS = 51
    # Per-host fan-out (docs/protocol.md §16): a generation as read-only shared-memory views.
    SHM_GEN_VIEW = 52
    GEN_PUBLISH_PART = 53
    GEN_GET_RANGES = 54
    # A GEN_PUBLISH_PART whose bytes an SHM_PUT's segments hold (docs/protocol.md §12.2, §14.8).
    SHM_GEN_PART = 55
    # RDMA through the Mooncake Transfer Engine (rdma://, docs/protocol.md §17; server/rdma.py).
    RDMA_ATTACH = 56
    RDMA_PUT = 57
    RDMA_GET = 58
    RDMA_END = 59


class Flags(enum.IntFlag):
    NONE = 0
    RESPONSE = 0x01
    ERROR = 0x02
    MORE = 0x04  # request: a part of a PUT_MANY, GEN_PUBLISH(_PART); more parts with the same id follow
    COMPRESSED = 0x08  # the data section's chunks carry chunk heads and may be compressed (§5.5)


_RESPONSE = int(Flags.RESPONSE)
_ERROR = int(Flags.ERROR)
OPCODES = frozenset(int(op) for op in Opcode)
CHECKSUM_KINDS = frozenset(int(kind) for kind in ChecksumKind)


@dataclass(slots=True)
class Header:
    version: int
    opcode: int
    flags: int
    checksum: int
    request_id: int
    meta_len: int
    chunk_size: int
    data_len: int
    crc: int = 0

    @property
    def is_response(self) -> bool:
        return bool(self.flags & _RESPONSE)  # plain ints: IntFlag's operators are slow Python

    @property
    def is_error(self) -> bool:
        return bool(self.flags & _ERROR)

    @property
    def wire_data_len(self) -> int:
        """Bytes of the data section on the wire: the data plus one trailer per chunk."""
        return wire_data_len(self.data_len, self.chunk_size)


def chunk_count(data_len: int, chunk_size: int) -> int:
    return -(-data_len // chunk_size) if data_len else 0


def wire_data_len(data_len: int, chunk_size: int) -> int:
    return data_len + TRAILER_BYTES * chunk_count(data_len, chunk_size)


def encode_frame_head(header: Header, meta: bytes) -> bytes:
    """Header bytes followed by the metadata block, with the header CRC filled in."""
    packed = _HEADER.pack(
        MAGIC,
        header.version,
        header.opcode,
        header.flags,
        header.checksum,
        header.request_id,
        len(meta),
        header.chunk_size,
        header.data_len,
        0,
    )
    crc = header_crc(packed[:_CRC_COVERS], meta)
    return packed[:_CRC_COVERS] + struct.pack("<I4x", crc) + meta


def decode_header(raw: bytes | bytearray | memoryview, limits: Limits) -> Header:
    """Parse and bound-check a header; the metadata CRC is checked later by ``check_meta_crc``."""
    magic, version, opcode, flags, kind, request_id, meta_len, chunk_size, data_len, crc = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a tensorwire peer")
    if version not in PROTOCOL_VERSIONS:
        raise UnsupportedVersion(f"frame version {version}; this side speaks {PROTOCOL_VERSIONS}")
    if meta_len > limits.max_meta_bytes:
        raise LimitExceeded(f"metadata block of {meta_len} bytes exceeds {limits.max_meta_bytes}")
    if data_len > limits.max_request_bytes:
        raise LimitExceeded(f"data section of {data_len} bytes exceeds {limits.max_request_bytes}")
    if data_len:
        if kind not in CHECKSUM_KINDS:
            raise ProtocolError(f"unknown checksum kind {kind}")
        if not limits.min_chunk_bytes <= chunk_size <= limits.max_chunk_bytes:
            raise LimitExceeded(
                f"chunk size {chunk_size} outside [{limits.min_chunk_bytes}, {limits.max_chunk_bytes}]"
            )
    return Header(version, opcode, flags, kind, request_id, meta_len, chunk_size, data_len, crc)


def check_meta_crc(raw_header: bytes | bytearray | memoryview, header: Header, meta: bytes) -> None:
    """Raise CorruptFrame unless the header CRC matches the header and metadata bytes received."""
    if header_crc(bytes(raw_header[:_CRC_COVERS]), meta) != header.crc:
        raise CorruptFrame(f"header/metadata checksum mismatch on request {header.request_id}")
