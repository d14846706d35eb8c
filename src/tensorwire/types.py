"""Plain data shared by every layer: tensor metadata, addresses, limits."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit

import torch

from tensorwire.errors import InvalidTensor

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


class TensorMeta(NamedTuple):
    """What a store knows about one tensor: its name, dtype, shape, byte size and version.

    ``version`` is 0 for a tensor that has not been stored yet; a store gives every put a new,
    strictly larger version (one counter per store, so versions never repeat after a delete).
    A named tuple rather than a dataclass: batches build one per tensor, and a tuple is built in a
    third of the time of a frozen dataclass.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    version: int = 0

    @staticmethod
    def of(name: str, tensor: torch.Tensor) -> TensorMeta:
        return TensorMeta(name, tensor.dtype, tuple(tensor.shape), tensor.nbytes)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def with_version(self, version: int) -> TensorMeta:
        return TensorMeta(self.name, self.dtype, self.shape, self.nbytes, version)

    def check_size(self) -> None:
        """Raise InvalidTensor unless ``nbytes`` equals numel x itemsize and no dim is negative."""
        numel = 1
        for d in self.shape:
            if d < 0:
                raise InvalidTensor(f"{self.name!r}: negative dimension in shape {self.shape}")
            numel *= d
        expected = numel * self.dtype.itemsize
        if expected != self.nbytes:
            raise InvalidTensor(
                f"{self.name!r}: shape {self.shape} of {self.dtype} needs {expected} bytes, "
                f"frame says {self.nbytes}"
            )


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed ``scheme://location`` address: ``tcp://host:port`` or ``memory://name``."""

    scheme: str
    host: str
    port: int = 0

    @staticmethod
    def parse(url: str) -> Address:
        if "://" not in url:
            raise ValueError(f"address {url!r} has no scheme; expected e.g. tcp://127.0.0.1:7070")
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme == "memory":
            name = parts.netloc + parts.path
            if not name:
                raise ValueError(f"address {url!r} names no in-process server")
            return Address(scheme, name)
        if parts.hostname is None:
            raise ValueError(f"address {url!r} has no host")
        try:
            port = parts.port or 0
        except ValueError as exc:
            raise ValueError(f"address {url!r} has an invalid port") from exc
        return Address(scheme, parts.hostname, port)

    def __str__(self) -> str:
        if self.scheme == "memory":
            return f"memory://{self.host}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Limits:
    """What a server accepts from a peer; each field bounds something a peer controls.

    A frame over any limit is refused with ``LimitExceeded`` before its payload is read into
    memory, so a hostile or buggy peer cannot make the server allocate without bound.
    """

    max_meta_bytes: int = 8 * MiB
    max_name_bytes: int = 1024
    max_ndim: int = 32
    max_batch: int = 100_000
    max_request_bytes: int = 64 * GiB
    min_chunk_bytes: int = 4 * KiB
    max_chunk_bytes: int = 64 * MiB
    max_inflight: int = 256

    @staticmethod
    def widest() -> Limits:
        """The widest limits a HELLO can carry: with these, only a decoder's own bounds checks stop
        a lying length or count (what fuzzers feed the decoders with)."""
        return Limits(
            max_meta_bytes=(1 << 32) - 1,
            max_name_bytes=1024,
            max_ndim=255,
            max_batch=(1 << 32) - 1,
            max_request_bytes=(1 << 64) - 1,
            min_chunk_bytes=1,
            max_chunk_bytes=(1 << 32) - 1,
        )

    def __post_init__(self) -> None:
        # Each field travels in a HELLO response field of fixed width (docs/protocol.md).
        widths = {
            "max_name_bytes": 16,
            "max_ndim": 8,
            "max_meta_bytes": 32,
            "max_batch": 32,
            "min_chunk_bytes": 32,
            "max_chunk_bytes": 32,
            "max_inflight": 32,
            "max_request_bytes": 64,
        }
        for name, bits in widths.items():
            value = getattr(self, name)
            if not 1 <= value < (1 << bits):
                raise ValueError(f"Limits.{name}={value} must be in [1, 2**{bits})")
        if self.max_name_bytes > 1024:
            raise ValueError("Limits.max_name_bytes cannot exceed 1024, the store's own bound on names")
        if self.min_chunk_bytes > self.max_chunk_bytes:
            raise ValueError("Limits.min_chunk_bytes exceeds max_chunk_bytes")


@dataclass(frozen=True, slots=True)
class Generation:
    """One published generation of a prefix (``client.publish``; docs/protocol.md §14).

    ``number`` counts 1, 2, 3, ... per prefix (the server assigns it); ``names`` are the full names
    (``prefix/key``), sorted; ``digest`` is the 16-byte root digest over every tensor's dtype,
    shape and per-chunk checksums in name order (``tensorwire.wire.generations.root_digest``).
    """

    prefix: str
    number: int
    digest: bytes
    names: tuple[str, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class ChunkSums:
    """One tensor of a generation as the server stored it: its metadata (``version`` is the
    generation number) and the checksum of each ``chunk_size`` bytes of it, in order (the last
    chunk may be shorter; a tensor of 0 bytes has none)."""

    meta: TensorMeta
    checksums: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GenerationManifest:
    """What a generation holds, to check its bytes with (``client.manifest``): every tensor's
    metadata and per-chunk checksums, in name order. ``checksum_kind`` is the frame protocol's
    checksum kind byte (1: xxh3-64, 2: CRC32C)."""

    generation: Generation
    chunk_size: int
    checksum_kind: int
    tensors: tuple[ChunkSums, ...]

    def tensor(self, name: str) -> ChunkSums:
        """The entry of ``name``; KeyError if the generation has no such tensor."""
        for entry in self.tensors:
            if entry.meta.name == name:
                return entry
        raise KeyError(name)

    def chunk(self, name: str, index: int) -> tuple[int, int, int]:
        """``(offset, length, checksum)`` of chunk ``index`` of ``name``: the byte range a relay
        reads with ``get_range`` and the checksum its bytes must have."""
        entry = self.tensor(name)
        offset = index * self.chunk_size
        return offset, min(self.chunk_size, entry.meta.nbytes - offset), entry.checksums[index]
