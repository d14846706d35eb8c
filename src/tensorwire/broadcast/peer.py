"""A reader's relay server: ``RelayPeer``, an ``Extension`` that serves RELAY_GET from the
memory the reader is filling (its model's own tensors), chunk by chunk, once each is verified.

Lifecycle: the ``Subscriber`` builds one, serves it on a ``Server`` of its own (same token and TLS
as the cluster, port 0) and, on the same event loop, calls ``hold`` when it starts receiving a
generation (from then on the previous one is no longer served), ``advance`` each time more chunks
are verified, and ``drop`` when it stops serving. A RELAY_GET for a chunk not verified yet is
parked until it is, at most ``wait_ms`` (capped by ``max_wait``): then WaitTimeout, and the reader
downstream reports this one as stalled. A RELAY_GET for a newer generation than the one held
waits for it at most ``JOIN_GRACE``: the origin may name this reader as an upstream a moment before
the reader has read the origin's answer and started holding it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorwire.errors import ProtocolError, VersionChanged, WaitTimeout
from tensorwire.server import Handler, Request
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import relay as wr
from tensorwire.wire.frame import Opcode

MAX_GET_CHUNKS = 64
JOIN_GRACE = 2.0  # seconds a RELAY_GET waits for this reader to start holding a newer generation


@dataclass(slots=True)
class Holding:
    """The generation a reader is receiving or holds, and how far it has verified it."""

    prefix: str
    manifest: wr.Manifest
    buffers: Sequence[memoryview]
    verified: int = 0  # chunks 0 .. verified-1 are in memory and checked
    moved: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) on each change


class RelayPeer:
    """Serves RELAY_GET from a reader's memory (see the module docstring)."""

    def __init__(self, max_wait: float = 30.0) -> None:
        self.max_wait = max_wait
        self._holding: Holding | None = None
        self._held = asyncio.Event()  # set (and replaced) each time a generation starts being held
        self.served = 0  # bytes sent downstream

    def frame_handlers(self) -> Mapping[int, Handler]:
        return {Opcode.RELAY_GET: self._on_get}

    def rpc_handlers(self) -> Sequence[Any]:
        return ()

    async def close(self) -> None:
        self.drop()

    def hold(self, prefix: str, manifest: wr.Manifest, buffers: Sequence[memoryview]) -> None:
        self.drop()
        self._holding = Holding(prefix, manifest, buffers)
        held, self._held = self._held, asyncio.Event()
        held.set()

    def advance(self, verified: int) -> None:
        holding = self._holding
        if holding is not None and verified > holding.verified:
            holding.verified = verified
            self._wake(holding)

    def drop(self) -> None:
        holding, self._holding = self._holding, None
        if holding is not None:
            self._wake(holding)

    @staticmethod
    def _wake(holding: Holding) -> None:
        moved, holding.moved = holding.moved, asyncio.Event()
        moved.set()

    async def _on_get(self, req: Request) -> None:
        if req.header.data_len:
            raise ProtocolError("RELAY_GET carries no data")
        prefix, generation, first, count, wait_ms = wr.decode_get(req.meta)
        wait = min(wait_ms / 1000, self.max_wait)
        with req.waiting():
            holding = await self._coming(prefix, generation, min(wait, JOIN_GRACE))
        holding.manifest.locate(first)  # ProtocolError for a chunk outside the generation
        with req.waiting():
            holding = await self._verified(prefix, generation, first, wait)
        manifest = holding.manifest
        index, offset, length = manifest.span(first, min(count, MAX_GET_CHUNKS, holding.verified - first))
        record = TensorMeta(manifest.metas[index].name, torch.uint8, (length,), length, generation)
        self.served += length
        await req.reply(wm.encode_records([record]), [holding.buffers[index][offset : offset + length]])

    def _current(self, prefix: str, generation: int) -> Holding:
        holding = self._holding
        if holding is None or holding.prefix != prefix or holding.manifest.generation != generation:
            raise VersionChanged(f"this reader does not hold generation {generation} of {prefix!r}")
        return holding

    async def _coming(self, prefix: str, generation: int, wait: float) -> Holding:
        """The holding of ``generation``, waiting at most ``wait`` seconds for it if this reader
        holds nothing of ``prefix`` or an older generation (VersionChanged then, or at once)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        while True:
            try:
                return self._current(prefix, generation)
            except VersionChanged:
                held, left = self._holding, until - loop.time()
                older = held is None or held.prefix != prefix or held.manifest.generation < generation
                if not older or left <= 0:
                    raise
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._held.wait(), left)

    async def _verified(self, prefix: str, generation: int, first: int, wait: float) -> Holding:
        """The holding once chunk ``first`` is verified; WaitTimeout after ``wait`` seconds."""
        loop = asyncio.get_running_loop()
        until = loop.time() + wait
        while True:
            holding = self._current(prefix, generation)
            if holding.verified > first:
                return holding
            left = until - loop.time()
            if left <= 0:
                raise WaitTimeout(
                    f"chunk {first} of generation {generation} of {prefix!r} not here within {wait:.3g}s"
                )
            try:
                await asyncio.wait_for(holding.moved.wait(), left)
            except TimeoutError:
                continue
