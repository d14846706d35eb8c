"""Many byte ranges of one generation, read in parallel into the caller's buffers
(``AsyncClient.read_generation``; what ``tensorwire.sharded`` reads a shard's overlaps with).

Lifecycle: ``open_read`` pins one generation of a prefix and says what it holds (``generation``,
``metas``: each tensor's record, by full name); ``read`` lands any number of ranges of its
tensors, each straight into its own writable buffer, many requests in flight; ``close`` lets the
generation go. Which way depends on what the transport can do (asked of it):

* ``RangedGenerations`` (tcp://, tls://, memory://, grpc://, grpcs://): GEN_MANIFEST, a lease
  (GEN_LEASE) for as long as the read is open, and one GEN_GET_RANGES per batch of a tensor's
  ranges (up to 2048 of them, 16 MiB), each range received into its own buffer (no copy over the
  frame protocol; over gRPC, one copy out of each message).
* ``GenerationViews`` (shm://): one SHM_GEN_VIEW maps the generation's pages (the server keeps it
  while the views live) and each range is one copy from the mapped pages into its buffer.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tensorwire.client.generations import AsyncLease, Run
from tensorwire.errors import InvalidTensor, UnsupportedTransport
from tensorwire.transport.base import GenerationViews, RangedGenerations, Transport, as_ranged_generations
from tensorwire.types import Generation, TensorMeta
from tensorwire.wire.tensors import byte_view

_WINDOW = 16384  # ranges asked for at once (the transport also waits for the server's in-flight room)
_BATCH_RANGES = 2048  # ranges in one GEN_GET_RANGES
_BATCH_BYTES = 16 << 20  # bytes in one GEN_GET_RANGES answer (several answers travel at once)
_LEASE_SECONDS = 120.0  # the server grants at most its --max-lease-seconds


@dataclass(frozen=True, slots=True)
class RangeRead:
    """Bytes ``offset .. offset + len(dest)`` of tensor ``name`` (a full name), into ``dest``."""

    name: str
    offset: int
    dest: memoryview


class AsyncGenerationRead(ABC):
    """One generation held for reading ranges of it (module docstring)."""

    def __init__(self, generation: Generation, metas: dict[str, TensorMeta]) -> None:
        self.generation = generation
        self.metas = metas

    async def read(self, reads: Sequence[RangeRead]) -> int:
        """Every range into its buffer; returns the bytes read. InvalidTensor before any byte
        moves if a range lies outside its tensor (or names none of this generation)."""
        for r in reads:
            meta = self.metas.get(r.name)
            if meta is None or r.offset < 0 or r.offset + r.dest.nbytes > meta.nbytes:
                raise InvalidTensor(f"bytes {r.offset}..{r.offset + r.dest.nbytes} of {r.name!r} are not"
                                    f" in generation {self.generation.number}")  # fmt: skip
        wanted = [r for r in reads if r.dest.nbytes]
        for start in range(0, len(wanted), _WINDOW):
            await self._read(wanted[start : start + _WINDOW])
        return sum(r.dest.nbytes for r in wanted)

    @abstractmethod
    async def _read(self, reads: Sequence[RangeRead]) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> AsyncGenerationRead:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Ranged(AsyncGenerationRead):
    def __init__(
        self, run: Run, generation: Generation, metas: dict[str, TensorMeta], lease: AsyncLease
    ) -> None:
        super().__init__(generation, metas)
        self._run = run
        self._lease = lease

    async def _read(self, reads: Sequence[RangeRead]) -> None:
        """One GEN_GET_RANGES per batch of one tensor's ranges, the batches in flight together."""
        number = self.generation.number

        async def one(name: str, batch: list[tuple[int, memoryview]]) -> int:
            return await self._run(
                lambda t: as_ranged_generations(t, "a ranged read").get_ranges_at(name, number, batch)
            )

        await asyncio.gather(*(one(name, batch) for name, batch in _batches(reads)))

    async def close(self) -> None:
        await self._lease.release()


class _Viewed(AsyncGenerationRead):
    def __init__(
        self, generation: Generation, views: dict[str, torch.Tensor], copied: Callable[[int], None]
    ) -> None:
        metas = {name: TensorMeta(name, v.dtype, tuple(v.shape), v.nbytes, generation.number)
                 for name, v in views.items()}  # fmt: skip
        super().__init__(generation, metas)
        self._bytes = {name: np.frombuffer(_readonly_bytes(v), dtype=np.uint8) for name, v in views.items()}
        self._views: dict[str, torch.Tensor] | None = views
        self._copied = copied  # counted as the transport's (``GenerationViews.copied_bytes``)

    async def _read(self, reads: Sequence[RangeRead]) -> None:
        for r in reads:
            src = self._bytes[r.name][r.offset : r.offset + r.dest.nbytes]
            np.frombuffer(r.dest, dtype=np.uint8)[:] = src
        self._copied(sum(r.dest.nbytes for r in reads))

    async def close(self) -> None:
        self._bytes.clear()
        self._views = None  # the server's lease ends once the last view is freed


def _batches(reads: Sequence[RangeRead]) -> list[tuple[str, list[tuple[int, memoryview]]]]:
    """``reads`` grouped by tensor, in their order, cut at ``_BATCH_RANGES`` ranges or
    ``_BATCH_BYTES`` bytes."""
    by_name: dict[str, list[list[tuple[int, memoryview]]]] = {}
    sizes: dict[str, int] = {}
    for r in reads:
        batches = by_name.setdefault(r.name, [[]])
        if len(batches[-1]) >= _BATCH_RANGES or (
            batches[-1] and sizes[r.name] + r.dest.nbytes > _BATCH_BYTES
        ):
            batches.append([])
            sizes[r.name] = 0
        batches[-1].append((r.offset, r.dest))
        sizes[r.name] = sizes.get(r.name, 0) + r.dest.nbytes
    return [(name, batch) for name, batches in by_name.items() for batch in batches]


def _readonly_bytes(view: torch.Tensor) -> memoryview:
    if view.numel() == 0:
        return memoryview(b"")
    return byte_view(view.contiguous())


async def open_read(run: Run, transport: Transport, prefix: str, at: int) -> AsyncGenerationRead:
    """Generation ``at`` (0: the newest) of ``prefix``, pinned for reading ranges of it."""
    if isinstance(transport, RangedGenerations):
        manifest = await run(lambda t: as_ranged_generations(t, "a ranged read").manifest(prefix, at))
        gen = manifest.generation
        lease = AsyncLease(run, prefix, gen.number)
        await lease.renew(_LEASE_SECONDS)
        return _Ranged(run, gen, {s.meta.name: s.meta for s in manifest.tensors}, lease)
    if isinstance(transport, GenerationViews):

        async def view(t: Transport) -> tuple[Generation, dict[str, torch.Tensor]]:
            if not isinstance(t, GenerationViews):
                raise UnsupportedTransport(f"{t.address} no longer serves generations as views")
            return await t.view_generation(prefix, at)

        gen, views = await run(view)
        return _Viewed(gen, views, transport.note_copied)
    as_ranged_generations(transport, "a ranged read of a generation")  # raises, naming the transport
    raise AssertionError("unreachable")


class GenerationRead:
    """``AsyncGenerationRead`` for the blocking client: the same methods, run on the client's loop
    (``read`` lands every range with many requests in flight, in one call)."""

    def __init__(self, read: AsyncGenerationRead, call: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self._read = read
        self._call = call

    @property
    def generation(self) -> Generation:
        return self._read.generation

    @property
    def metas(self) -> dict[str, TensorMeta]:
        return self._read.metas

    def read(self, reads: Sequence[RangeRead]) -> int:
        return int(self._call(self._read.read(reads)))

    def close(self) -> None:
        self._call(self._read.close())

    def __enter__(self) -> GenerationRead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
