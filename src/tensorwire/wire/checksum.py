"""Per-chunk checksums from maintained libraries: xxh3-64 (default, ~30 GB/s) and CRC32C.

Both are computed incrementally so that a chunk spread over several destination buffers is
checked without first being copied into one place.
"""

from __future__ import annotations

import enum
from typing import Protocol

import google_crc32c
import numpy as np
import xxhash

from tensorwire.errors import ProtocolError

Buffer = bytes | bytearray | memoryview


class ChecksumKind(enum.IntEnum):
    """Checksum algorithms; the value is the byte in the frame header."""

    XXH3_64 = 1
    CRC32C = 2


class Hasher(Protocol):
    def update(self, data: Buffer) -> None: ...
    def digest(self) -> int: ...


class _Xxh3:
    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: Buffer) -> None:
        self._h.update(data)

    def digest(self) -> int:
        return int(self._h.intdigest())


class _Crc32c:
    __slots__ = ("_crc",)

    def __init__(self) -> None:
        self._crc = 0

    def update(self, data: Buffer) -> None:
        # google_crc32c only takes read-only objects; a uint8 numpy view of the buffer costs no copy.
        self._crc = google_crc32c.extend(self._crc, np.frombuffer(data, dtype=np.uint8))

    def digest(self) -> int:
        return int(self._crc)


def new_hasher(kind: int) -> Hasher:
    """A fresh incremental hasher for ``kind``; ProtocolError for an unknown kind byte."""
    if kind == ChecksumKind.XXH3_64:
        return _Xxh3()
    if kind == ChecksumKind.CRC32C:
        return _Crc32c()
    raise ProtocolError(f"unknown checksum kind {kind}")


def checksum(kind: int, data: Buffer) -> int:
    """The checksum of one contiguous buffer."""
    if kind == ChecksumKind.XXH3_64:
        return int(xxhash.xxh3_64_intdigest(data))
    hasher = new_hasher(kind)
    hasher.update(data)
    return hasher.digest()


def header_crc(head: bytes, meta: bytes) -> int:
    """CRC32C over the frame header's first 32 bytes and the metadata block."""
    return int(google_crc32c.value(head + meta))  # one C call; the copy is of a few small bytes
