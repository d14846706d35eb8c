"""Striping: one large tensor moved over several connections at once (docs/protocol.md §11.7).

A put cuts the tensor's bytes into K ranges and sends each with PUT_RANGE on its own connection
into one server-side upload, then publishes the whole with one PUT_COMMIT: a partial striped put is
never visible. A get asks each connection for one range with GET_RANGE, pinned to the version a
STAT saw (VERSION_CHANGED if the tensor moves on meanwhile: the client reads it again), and each
range lands in place in the destination tensor.

Each extra connection (a ``Lane``) runs on its own event-loop thread, so the K connections' copies
and checksums run on K cores, not interleaved on one. The client stripes only over a transport
that is ``Ranged`` and says striping pays (``parallel``: tcp://, tls://); a lane's connection is
opened and checked by ``transport.open_ranged`` and its ranges retried by ``client/retry.py``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence

from tensorwire import transport as transports
from tensorwire._aio import LoopThread
from tensorwire.client.retry import RetryPolicy, retrying
from tensorwire.transport.base import Ranged
from tensorwire.types import Address, TensorMeta

StripeOp = Callable[[Ranged], Awaitable[None]]

MIN_STRIPE = 16 << 20  # a stripe smaller than this is not worth its own connection
MAX_AUTO_STRIPES = 8
ALIGN = 1 << 20  # ranges start on MiB boundaries: whole chunks, page-aligned copies


def stripe_count(nbytes: int, stripes: int, threshold: int, cpus: int | None = None) -> int:
    """How many connections a tensor of ``nbytes`` travels over: 1 below ``threshold`` (or when
    ``stripes`` is 1); ``stripes`` when set; else one per usable core, at most 8, each ≥ 16 MiB."""
    if stripes == 1 or not threshold or nbytes < threshold:
        return 1
    if stripes > 1:
        return stripes
    cores = cpus if cpus is not None else usable_cores()
    return max(1, min(MAX_AUTO_STRIPES, cores, nbytes // MIN_STRIPE))


def usable_cores() -> int:
    """The CPUs this thread may run on (a process pinned to one core gains nothing from lanes)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cut(nbytes: int, k: int) -> list[tuple[int, int]]:
    """``k`` (offset, length) ranges tiling ``nbytes``, MiB-aligned, the last one taking the rest."""
    step = max(ALIGN, -(-nbytes // k // ALIGN) * ALIGN)
    ranges = []
    offset = 0
    while offset < nbytes:
        length = min(step, nbytes - offset)
        ranges.append((offset, length))
        offset += length
    return ranges


class Lane:
    """One extra connection, on its own loop thread; reopened after a break."""

    def __init__(self, address: Address, options: transports.TransportOptions, index: int) -> None:
        self.address = address
        self.options = options
        self.thread = LoopThread(f"tensorwire-stripe-{index}")
        self._transport: Ranged | None = None

    async def _connect(self) -> Ranged:
        if self._transport is None or self._transport.closed:
            self._transport = await transports.open_ranged(self.address, self.options, what="striping")
        return self._transport

    async def run(self, op: StripeOp, policy: RetryPolicy) -> None:
        """From any loop: ``op`` on this lane's connection (on the lane's loop), retried on a new
        connection when that can help, and wait for it."""
        await asyncio.wrap_future(self.thread.submit(retrying(op, self._connect, policy)))

    async def _close(self) -> None:
        if self._transport is not None:
            await self._transport.close()
            self._transport = None

    def close(self) -> None:
        if not self.thread.loop.is_closed():
            try:
                self.thread.call(self._close(), 10.0, f"closing a stripe connection to {self.address}")
            finally:
                self.thread.stop()


class Stripes:
    """The extra connections of one client, made as striping first needs them."""

    def __init__(self, address: Address, options: transports.TransportOptions) -> None:
        self.address = address
        self.options = options
        self.lanes: list[Lane] = []

    async def run(self, ops: Sequence[StripeOp], retries: int, delay: Callable[[int], float]) -> None:
        """Every op on its own lane, all at once, each retried ``retries`` times on its own (waiting
        ``delay(attempt)`` before each); the first failure is raised once all have ended."""
        while len(self.lanes) < len(ops):
            self.lanes.append(Lane(self.address, self.options, len(self.lanes)))
        policy = RetryPolicy(retries, delay)
        results = await asyncio.gather(
            *(lane.run(op, policy) for lane, op in zip(self.lanes, ops, strict=False)),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def close(self) -> None:
        lanes, self.lanes = self.lanes, []
        for lane in lanes:
            lane.close()


def put_ops(upload: int, meta: TensorMeta, view: memoryview, k: int) -> list[StripeOp]:
    """One PUT_RANGE per range of ``view`` (the tensor's bytes) into upload ``upload``."""

    def op_for(offset: int, length: int) -> StripeOp:
        async def op(t: Ranged) -> None:
            await t.put_range(upload, meta, offset, view[offset : offset + length])

        return op

    return [op_for(offset, length) for offset, length in cut(meta.nbytes, k)]


def get_ops(meta: TensorMeta, dest: memoryview, k: int) -> list[StripeOp]:
    """One GET_RANGE per range of ``meta``'s tensor at ``meta.version``, landing in ``dest``."""

    def op_for(offset: int, length: int) -> StripeOp:
        async def op(t: Ranged) -> None:
            await t.get_range(meta, offset, dest[offset : offset + length])

        return op

    return [op_for(offset, length) for offset, length in cut(meta.nbytes, k)]
