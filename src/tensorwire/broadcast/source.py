"""Where the origin's coordinator finds a generation: its manifest and its bytes.

This is the one place that knows how generations are kept. ``GenerationSource`` (what ``tensorwire
serve`` uses) reads the server's published generations (``client.publish``; store/generations.py):
their manifests come with the per-chunk checksums computed when they were received, and a read pins
its generation while it sends. ``StoreSource`` reads plain versioned tensors off a ``TensorStore``
(``put_many``), with a chunk size of its own (tests use small ones, so a fault lands
mid-transfer): the generation of a prefix is the newest version among the tensors under it (an
atomic ``put_many`` gives all of its tensors one version), and a read at generation ``g`` checks
that each tensor is still at the version the manifest names (``VersionChanged`` otherwise: the
reader asks for the newest generation again). The manifest's chunk checksums are computed once per
generation, off the loop, while the tensors are pinned.

Lifecycle: the coordinator builds one source over the server's store, asks ``manifest(prefix)``
on each RELAY_JOIN and ``read(...)`` on each RELAY_GET served by the origin.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Protocol

from tensorwire.errors import KeyNotFound, VersionChanged
from tensorwire.store import TensorStore
from tensorwire.store.generations import Generations
from tensorwire.wire import generations as wg
from tensorwire.wire import relay as wr
from tensorwire.wire.checksum import ChecksumKind

DEFAULT_CHUNK_BYTES = 1 << 20  # a relay hop forwards a chunk as soon as it has verified it
_KEEP_MANIFESTS = 8


class Source(Protocol):
    """What the coordinator needs of the origin's generations."""

    async def manifest(self, prefix: str) -> wr.Manifest:
        """The newest generation of ``prefix``; KeyNotFound if there is none."""
        ...

    async def manifest_of(self, prefix: str, generation: int) -> wr.Manifest:
        """Generation ``generation`` of ``prefix`` while it is kept (a reader the relay did not
        register reads it from the origin with no table to find it in); GenerationRetired or
        VersionChanged once it is gone."""
        ...

    def read(
        self, prefix: str, manifest: wr.Manifest, index: int
    ) -> contextlib.AbstractContextManager[memoryview]:
        """The bytes of tensor ``index`` of ``manifest``'s generation, pinned while inside;
        GenerationRetired or VersionChanged once that generation is gone."""
        ...


class GenerationSource:
    """The server's published generations (see the module docstring)."""

    def __init__(self, generations: Generations) -> None:
        self.generations = generations
        self._manifests: dict[tuple[str, int], wr.Manifest] = {}  # the last few, newest last

    async def manifest(self, prefix: str) -> wr.Manifest:
        return self._manifest(prefix, wg.LATEST)

    async def manifest_of(self, prefix: str, generation: int) -> wr.Manifest:
        if generation == wg.LATEST:
            raise VersionChanged(f"RELAY_GET names a generation of {prefix!r} by its number, not 0")
        return self._manifest(prefix, generation)

    def _manifest(self, prefix: str, at: int) -> wr.Manifest:
        kept = self.generations.find(prefix, at)
        key = (prefix, kept.generation.number)
        cached = self._manifests.get(key)
        if cached is None:
            full = self.generations.manifest(kept)
            sums = tuple(c for entry in full.tensors for c in entry.checksums)
            metas = tuple(entry.meta for entry in full.tensors)
            cached = wr.Manifest(kept.generation.number, full.chunk_size, metas, sums, full.checksum_kind)
            _remember(self._manifests, key, cached)
        return cached

    @contextlib.contextmanager
    def read(self, prefix: str, manifest: wr.Manifest, index: int) -> Iterator[memoryview]:
        kept = self.generations.pin(prefix, manifest.generation)
        try:
            meta = manifest.metas[index]
            _, data = kept.tensors[meta.name]
            yield data[: meta.nbytes]
        finally:
            self.generations.unpin(kept)


class StoreSource:
    """Generations of a plain ``TensorStore`` (see the module docstring)."""

    def __init__(self, store: TensorStore, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        self.store = store
        self.chunk_bytes = chunk_bytes
        self._manifests: dict[tuple[str, int], wr.Manifest] = {}  # the last few, newest last

    async def manifest(self, prefix: str) -> wr.Manifest:
        metas = self.store.list(prefix)
        if not metas:
            raise KeyNotFound(f"nothing is published under {prefix!r}")
        generation = max(m.version for m in metas)
        key = (prefix, generation)
        cached = self._manifests.get(key)
        if cached is not None:
            return cached
        entries = self.store.acquire([m.name for m in metas])
        try:
            if any(e.meta.version > generation for e in entries):
                raise VersionChanged(f"{prefix!r} changed while its manifest was being made; ask again")
            buffers = [e.data[: e.meta.nbytes] for e in entries]
            kind = ChecksumKind.XXH3_64
            sums = await asyncio.to_thread(wr.checksums_of, kind, buffers, self.chunk_bytes)
            manifest = wr.Manifest(generation, self.chunk_bytes, tuple(e.meta for e in entries), sums, kind)
        finally:
            self.store.release(entries)
        _remember(self._manifests, key, manifest)
        return manifest

    async def manifest_of(self, prefix: str, generation: int) -> wr.Manifest:
        manifest = await self.manifest(prefix)  # plain tensors keep only their newest version
        if manifest.generation != generation:
            raise VersionChanged(
                f"generation {generation} of {prefix!r} is retired; the newest is {manifest.generation}"
            )
        return manifest

    @contextlib.contextmanager
    def read(self, prefix: str, manifest: wr.Manifest, index: int) -> Iterator[memoryview]:
        meta = manifest.metas[index]
        try:
            (entry,) = self.store.acquire([meta.name])
        except KeyNotFound as exc:
            raise VersionChanged(f"{meta.name!r} of generation {manifest.generation} is gone") from exc
        try:
            if entry.meta.version != meta.version:
                raise VersionChanged(
                    f"{meta.name!r} is at version {entry.meta.version}, not that of generation "
                    f"{manifest.generation}: ask for the newest generation"
                )
            yield entry.data[: meta.nbytes]
        finally:
            self.store.release([entry])


def _remember(
    manifests: dict[tuple[str, int], wr.Manifest], key: tuple[str, int], manifest: wr.Manifest
) -> None:
    """Cache a manifest; the oldest go beyond a few (a relay serves the newest generations)."""
    manifests[key] = manifest
    while len(manifests) > _KEEP_MANIFESTS:
        del manifests[next(iter(manifests))]
