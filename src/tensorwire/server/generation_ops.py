"""Generations as handlers in the server's one opcode table (docs/protocol.md §14): GEN_PUBLISH,
GEN_GET, GEN_GET_RANGE, GEN_GET_RANGES, GEN_MANIFEST, GEN_WAIT, GEN_LEASE and GEN_PUBLISH_PART
(its transactions in generation_parts.py), over store/generations.py.

A publish is received like a PUT_MANY (``StoreOps.receive_parts``: parts over several frames, a
refused or broken one never visible), its chunk checksums are computed here from the received,
verified bytes (a client's claim is never taken), and it is published at once.

GEN_WAIT does not hold up its connection: when no newer generation exists yet, the request is
parked on the prefix's ``asyncio.Event`` (set by every publish; no polling anywhere) in a task of
its own, and the session goes on serving the connection's next frames; the parked request is
answered when a publish wakes it or its timeout passes (``WaitTimeout`` naming the prefix and the
generation). Parked waits are bounded per connection, per client host and server-wide, and end
with their connection. Leases end with their connection too, and a timer retires a leased
generation when its lease runs out.

Memory a reader makes the server hold while it is slow to read counts against the store's one
capacity (``TensorStore.hold``): the copy of a wait's answer (one generation block, encoded once
per generation however many waits it wakes) while it is sent, a manifest's encoding, a delta
answer's encoded deltas (delta_answers.py). Where there is no room the request is refused
(CapacityExceeded naming --capacity), or a delta answer sends full chunks instead.

A publish returns once its generation is in the data directory, when there is one
(``Generations.publish_durable``); from its last byte on, the request waits on the server
(``Request.waiting``), not on its peer, so the stall watchdog leaves a publish behind a slow disk
alone. GEN_DROP is refused while another connection holds a lease on the prefix
(``Generations.drop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorwire._aio import within
from tensorwire.errors import (
    CapacityExceeded,
    GenerationRetired,
    KeyNotFound,
    LimitExceeded,
    ProtocolError,
    TensorwireError,
    WaitTimeout,
)
from tensorwire.logs import event
from tensorwire.server import delta_answers
from tensorwire.server.generation_parts import PartPublishes
from tensorwire.server.request import Handler, Request
from tensorwire.server.store_ops import Parts, StoreOps, cpu
from tensorwire.store import Reservation
from tensorwire.store.generations import Generations, Kept, Sums, check_names
from tensorwire.store.uploads import client_of
from tensorwire.types import Generation, TensorMeta
from tensorwire.wire import delta_reads as dr
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm
from tensorwire.wire.frame import Opcode, chunk_count
from tensorwire.wire.names import validate_name

_OFF_LOOP_BYTES = 8 << 20  # checksums of a larger generation are computed on a worker thread
log = logging.getLogger("tensorwire.server.generations")


@dataclass(eq=False)
class _Held:
    """What one connection holds here: its parked waits; its leases are keyed by this object."""

    client: str = ""  # its client host (``client_of``), whose quotas it counts against
    waits: set[asyncio.Task[None]] = field(default_factory=set)
    timers: dict[tuple[str, int], asyncio.TimerHandle] = field(default_factory=dict)  # lease ends
    on_close: Callable[[_Held], None] | None = None

    def close(self) -> None:
        if self.on_close is not None:
            self.on_close(self)


class GenerationOps:
    """The generation handlers of one server (``frame_handlers``)."""

    def __init__(self, generations: Generations, store_ops: StoreOps, *, max_wait: float) -> None:
        self.generations = generations
        self.store_ops = store_ops
        self.limits = store_ops.limits
        self.max_wait = min(max_wait, generations.config.max_wait_seconds)
        self._published: dict[str, asyncio.Event] = {}  # prefix -> set by its next publish
        self._parked_on: dict[str, int] = {}  # prefix -> waits parked on it
        self.waiting = 0  # parked GEN_WAITs, server-wide
        self._client_waits: Counter[str] = Counter()  # ... by client host
        self.deltas_full_for_capacity = 0  # delta chunks sent in full: no room to hold the delta
        self.parts = PartPublishes(generations, store_ops, self._announce, max_wait=max_wait)

    def frame_handlers(self) -> dict[int, Handler]:
        return {
            Opcode.GEN_PUBLISH: self.publish,
            Opcode.GEN_GET: self.get,
            Opcode.GEN_GET_RANGE: self.get_range,
            Opcode.GEN_MANIFEST: self.manifest,
            Opcode.GEN_WAIT: self.wait,
            Opcode.GEN_LEASE: self.lease,
            Opcode.GEN_GET_DELTA: self.get_delta,
            Opcode.GEN_PUBLISH_PART: self.parts.publish_part,
            Opcode.GEN_GET_RANGES: self.get_ranges,
            Opcode.GEN_DROP: self.drop,
        }

    def _held(self, req: Request) -> _Held:
        held = req.session_state(_Held)
        if held.on_close is None:
            held.on_close = self._connection_closed
            held.client = client_of(req.peer)
        return held

    def _connection_closed(self, held: _Held) -> None:
        for task in list(held.waits):
            task.cancel()
        for timer in held.timers.values():
            timer.cancel()
        held.timers.clear()
        self.generations.drop_owner(held)

    # -- publish --------------------------------------------------------------------------------
    async def publish(self, req: Request) -> None:
        head = functools.partial(self._head, client_of(req.peer))
        await self.store_ops.receive_parts(req, self._published_parts, head)

    def _head(self, client: str, reader: wm.MetaReader, parts: Parts) -> None:
        prefix = wg.decode_prefix(reader)
        if parts.head is None:
            self.generations.admit(prefix, client=client)  # before a byte is reserved
            parts.head = prefix
        elif prefix != parts.head:
            raise ProtocolError(f"parts of one GEN_PUBLISH name prefixes {parts.head!r} and {prefix!r}")

    async def _published_parts(self, req: Request, parts: Parts) -> None:
        res, prefix = parts.reservation, parts.head
        error = parts.error
        if error is None and (prefix is None or not res.metas):
            error = ProtocolError("GEN_PUBLISH carried no tensors")
        if error is not None:
            parts.abort()
            raise error
        assert prefix is not None
        # Every byte is in: from here the request waits on the server (its checksums, then the data
        # directory's write, behind any other publish being written), not on its peer, however long
        # a slow disk takes; the stall watchdog must not cut the connection (its publisher would
        # hear it failed while its generation is published).
        with req.waiting():
            try:
                check_names(prefix, [m.name for m in res.metas])
                big = res.nbytes >= _OFF_LOOP_BYTES
                sums = await cpu(big, lambda: [wg.chunk_checksums(b) for b in res.buffers])
            except BaseException:
                parts.abort()
                raise
            gen = await self._announce(prefix, res, sums, client=client_of(req.peer))
        await req.reply(wg.encode_generation(gen))

    async def _announce(
        self,
        prefix: str,
        res: Reservation,
        sums: Sums,
        number: int = 0,
        *,
        client: str | None = None,
    ) -> Generation:
        """Publish ``res`` (verified; ``sums`` its chunk checksums; it owns ``res`` from here),
        durably where the store has a data directory, and wake the prefix's waiters."""
        gen = await self.generations.publish_durable(prefix, res, sums, number, client=client)
        event = self._published.pop(prefix, None)
        if event is not None:
            event.set()  # every parked waiter of the prefix wakes and answers
        return gen

    async def publish_copy(
        self, prefix: str, tensors: Sequence[tuple[TensorMeta, memoryview]], number: int = 0
    ) -> Generation:
        """Publish ``tensors`` (records and their bytes, in this process) as a generation of
        ``prefix``, numbered ``number`` if that is past the latest (``Generations.publish``): one
        copy into the store's buffers (shared-memory segments on a server that serves shm://), on
        a worker thread when large, then visible at once, every tensor together, as a GEN_PUBLISH
        is. A host leader shares what it received this way (broadcast/host.py)."""
        self.generations.admit(prefix)
        store = self.generations.store
        res = store.reserve([meta for meta, _ in tensors])
        try:
            check_names(prefix, [m.name for m in res.metas])
            sources = [data for _, data in tensors]
            sums = await cpu(res.nbytes >= _OFF_LOOP_BYTES, _copy_and_sum, res.buffers, sources)
        except BaseException:
            store.abort(res)
            raise
        return await self._announce(prefix, res, sums, number)

    # -- reads ----------------------------------------------------------------------------------
    async def get(self, req: Request) -> None:
        _no_data(req)
        at, names = wg.decode_get(req.meta)
        req.meta.done()
        if not names or len(set(names)) != len(names):
            raise ProtocolError("GEN_GET names no tensor, or one twice")
        kept = self.generations.pin(self.generations.prefix_of(names), at)
        try:
            pairs = [_tensor(kept, name) for name in names]
            total = sum(m.nbytes for m, _ in pairs)
            if total > self.limits.max_request_bytes:
                raise LimitExceeded(f"an answer of {total} bytes exceeds {self.limits.max_request_bytes}")
            gen = kept.generation
            meta = wm.encode_records([m for m, _ in pairs]) + wg.encode_read_answer(
                gen.prefix, gen.number, gen.digest
            )
            await req.reply(meta, [b for _, b in pairs])
        finally:
            self.generations.unpin(kept)

    async def get_delta(self, req: Request) -> None:
        """Generation ``at`` for a reader that holds ``base``: per chunk a delta or the full chunk
        (server/delta_answers.py). A base no longer kept (or never published) is no error: every
        chunk goes FULL, as to a reader with nothing. Both generations stay pinned until sent."""
        _no_data(req)
        at, base, names = dr.decode_request(req.meta)
        req.meta.done()
        if not names or len(set(names)) != len(names):
            raise ProtocolError("GEN_GET_DELTA names no tensor, or one twice")
        prefix = self.generations.prefix_of(names)
        kept = self.generations.pin(prefix, at)
        old: Kept | None = None
        charges = delta_answers.Charges(self.generations.store)
        try:
            old = self._pin_base(prefix, base)
            pairs = [_tensor(kept, name) for name in names]
            # at most the FULL forms: each chunk and its kind byte
            total = sum(m.nbytes + chunk_count(m.nbytes, wg.CHUNK_BYTES) for m, _ in pairs)
            if total > self.limits.max_request_bytes:
                raise LimitExceeded(f"an answer of {total} bytes exceeds {self.limits.max_request_bytes}")
            big = old is not None and total >= _OFF_LOOP_BYTES
            budget = delta_answers.DEFAULT_BUDGET
            answer, data = await cpu(big, delta_answers.build, kept, old, pairs, budget, charges)
            self._count_full(charges)
            await req.reply(dr.encode_answer(answer), data)
        finally:
            charges.release()
            self.generations.unpin(kept)
            if old is not None:
                self.generations.unpin(old)

    def _count_full(self, charges: delta_answers.Charges) -> None:
        """Deltas sent as full chunks for want of room: counted (STATUS) and logged."""
        if charges.refused:
            self.deltas_full_for_capacity += charges.refused
            event(log, logging.INFO, "delta answer: chunks sent in full, no room to hold their deltas",
                  chunks=charges.refused, used=self.generations.store.used)  # fmt: skip

    def _pin_base(self, prefix: str, base: int) -> Kept | None:
        """Generation ``base`` pinned, or None where there is none to diff against (0: none)."""
        if base == wg.LATEST:
            return None
        try:
            return self.generations.pin(prefix, base)
        except (GenerationRetired, KeyNotFound):
            return None

    async def get_range(self, req: Request) -> None:
        """Bytes ``offset .. offset + length`` of one tensor of one generation, as one uint8
        record (its version: the generation number)."""
        _no_data(req)
        at, offset, length, names = wm.decode_get_range(req.meta)
        req.meta.done()
        if len(names) != 1:
            raise ProtocolError(f"GEN_GET_RANGE names one tensor, not {len(names)}")
        kept = self.generations.pin(self.generations.prefix_of(names), at)
        try:
            meta, data = _tensor(kept, names[0])
            wg.check_range(meta, offset, length)
            record = TensorMeta(meta.name, torch.uint8, (length,), length, meta.version)
            await req.reply(wm.encode_records([record]), [data[offset : offset + length]])
        finally:
            self.generations.unpin(kept)

    async def get_ranges(self, req: Request) -> None:
        """Many byte ranges of one tensor of one generation in one answer: one uint8 record of
        their total length (its version: the generation number), the ranges' bytes in order."""
        _no_data(req)
        at, ranges, names = wg.decode_get_ranges(req.meta)
        req.meta.done()
        if len(names) != 1:
            raise ProtocolError(f"GEN_GET_RANGES names one tensor, not {len(names)}")
        total = sum(length for _, length in ranges)
        if total > self.limits.max_request_bytes:
            raise LimitExceeded(f"an answer of {total} bytes exceeds {self.limits.max_request_bytes}")
        kept = self.generations.pin(self.generations.prefix_of(names), at)
        try:
            meta, data = _tensor(kept, names[0])
            for offset, length in ranges:
                wg.check_range(meta, offset, length)
            record = TensorMeta(meta.name, torch.uint8, (total,), total, meta.version)
            await req.reply(wm.encode_records([record]), [data[o : o + n] for o, n in ranges if n])
        finally:
            self.generations.unpin(kept)

    async def manifest(self, req: Request) -> None:
        _no_data(req)
        prefix, at = wg.decode_manifest_request(req.meta)
        req.meta.done()
        kept = self.generations.find(prefix, at)
        body = await cpu(len(kept.sums) >= 2048, wg.encode_manifest, self.generations.manifest(kept))
        with self.generations.store.holding(2 * len(body)):  # the body, and its frame's copy
            await req.reply(body)

    # -- waits and leases -----------------------------------------------------------------------
    async def wait(self, req: Request) -> None:
        """Answer at once when a generation after ``after`` exists; else park (module docstring)."""
        _no_data(req)
        prefix, after, timeout_ms = wg.decode_wait(req.meta)
        req.meta.done()
        block = self.generations.announcement(prefix, after)
        if block is not None:
            with self.generations.store.holding(len(block)):
                await req.reply(block)
            return
        validate_name(prefix)
        if not timeout_ms:
            raise _timed_out(prefix, after, 0)
        held = self._held(req)
        self._check_park(held)
        timeout = min(timeout_ms / 1000, self.max_wait)
        # Counted here, not in the task: the session reads the next frame before the task runs.
        self.waiting += 1
        self._client_waits[held.client] += 1
        self._parked_on[prefix] = self._parked_on.get(prefix, 0) + 1
        task = asyncio.get_running_loop().create_task(self._park(req, prefix, after, timeout))
        held.waits.add(task)
        task.add_done_callback(functools.partial(self._unparked, prefix, held))

    def _check_park(self, held: _Held) -> None:
        """LimitExceeded, naming the bound and its flag, unless one more wait may park."""
        limits = self.generations.config
        if len(held.waits) >= limits.waiters_per_owner:
            parked = f"this connection has {len(held.waits)} waits parked"
            raise LimitExceeded(f"{parked}: {limits.most('waiters_per_owner')}")
        if self._client_waits[held.client] >= limits.waiters_per_client:
            parked = f"this client ({held.client}) has {self._client_waits[held.client]} waits parked"
            raise LimitExceeded(f"{parked}: {limits.most('waiters_per_client')}")
        if self.waiting >= limits.max_waiters:
            parked = f"{self.waiting} waits are parked on this server"
            raise LimitExceeded(f"{parked}: {limits.most('max_waiters')}")

    def _unparked(self, prefix: str, held: _Held, task: asyncio.Task[None]) -> None:
        """A parked wait ended (answered, or cancelled with its connection, even before it ran)."""
        held.waits.discard(task)
        self.waiting -= 1
        self._client_waits[held.client] -= 1
        if self._client_waits[held.client] <= 0:
            del self._client_waits[held.client]
        self._parked_on[prefix] -= 1
        if not self._parked_on[prefix]:  # the last waiter of the prefix: forget its event
            del self._parked_on[prefix]
            self._published.pop(prefix, None)

    async def _park(self, req: Request, prefix: str, after: int, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with contextlib.suppress(TensorwireError):  # the connection is gone: nobody to answer
            while True:
                block = self.generations.announcement(prefix, after)
                if block is not None:
                    await self._notify(req, block)
                    return
                left = deadline - loop.time()
                if left <= 0:
                    await req.reply_error(_timed_out(prefix, after, timeout))
                    return
                event = self._published.setdefault(prefix, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await within(event.wait(), left)

    async def _notify(self, req: Request, block: bytes) -> None:
        """A parked wait's answer: its frame's copy of ``block`` counts against the capacity while
        it is sent (a reader that does not read keeps it); with no room, CapacityExceeded instead."""
        try:
            with self.generations.store.holding(len(block)):
                await req.reply(block)
        except CapacityExceeded as exc:
            await req.reply_error(exc)

    async def lease(self, req: Request) -> None:
        _no_data(req)
        prefix, number, ms = wg.decode_lease(req.meta)
        req.meta.done()
        held = self._held(req)
        granted, oldest = self.generations.lease(held, prefix, number, ms / 1000, client=held.client)
        timer = held.timers.pop((prefix, number), None)
        if timer is not None:
            timer.cancel()
        if granted:  # retire it when the lease runs out (one timer per lease: a renewal replaces it)
            # A little past the end: asyncio may run a timer up to its clock resolution early.
            ran_out = functools.partial(self._lease_ran_out, held, prefix, number)
            held.timers[(prefix, number)] = asyncio.get_running_loop().call_later(granted + 0.01, ran_out)
        await req.reply(wg.encode_leased(round(granted * 1000), oldest))

    def _lease_ran_out(self, held: _Held, prefix: str, number: int) -> None:
        held.timers.pop((prefix, number), None)  # the connection's timers: only its live leases
        self.generations.retire(prefix)

    async def drop(self, req: Request) -> None:
        """GEN_DROP: every generation of a prefix goes, and the prefix (``Generations.drop``);
        answered once that is durable."""
        _no_data(req)
        prefix = wg.decode_prefix(req.meta)
        req.meta.done()
        with req.waiting():  # the data directory's removal, on the disk thread
            count = await self.generations.drop(prefix, self._held(req))
        await req.reply(wg.encode_dropped(count))

    def status(self) -> dict[str, Any]:
        gens = self.generations
        return {"generations": {"prefixes": len(gens), "kept": gens.generations, "waiting": self.waiting,
                                "bytes": gens.store.kept, "transactions": len(self.parts.open),
                                "leases": gens.leases, "durable": gens.disk is not None,
                                "disk_errors": gens.disk_errors, "quarantined": gens.quarantined,
                                "deltas_full_for_capacity": self.deltas_full_for_capacity,
                                "newest": gens.newest()}}  # fmt: skip


def _tensor(kept: Kept, name: str) -> tuple[TensorMeta, memoryview]:
    pair = kept.tensors.get(name)
    if pair is None:
        gen = kept.generation
        raise KeyNotFound(f"generation {gen.number} of {gen.prefix!r} has no tensor {name!r}")
    return pair


def _copy_and_sum(dests: Sequence[memoryview], sources: Sequence[memoryview]) -> list[tuple[int, ...]]:
    """Copy each source into its buffer; the chunk checksums of what was copied."""
    sums = []
    for dest, source in zip(dests, sources, strict=True):
        dest[:] = source
        sums.append(wg.chunk_checksums(dest))
    return sums


def _timed_out(prefix: str, after: int, waited: float) -> WaitTimeout:
    return WaitTimeout(f"no generation of {prefix!r} after {after} was published within {waited:.3g}s")


def _no_data(req: Request) -> None:
    if req.header.data_len:
        raise ProtocolError(f"a generation read or wait carries no data ({req.header.data_len} bytes sent)")
