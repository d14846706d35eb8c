"""GEN_PUBLISH_PART (docs/protocol.md §14.8): one generation published from the parts of several
connections (the ranks of a job, each uploading only its own shards), visible all at once or not
at all.

Lifecycle of a transaction (``_Txn``), keyed by its prefix and 16-byte id:

1. The first frame of its first part to arrive opens it (bounded: ``max_transactions`` open
   server-wide, ``transactions_per_owner`` with a part from one connection,
   ``transactions_per_client`` from one client host, ``max_parts`` parts; its timeout is capped at
   the server's longest wait) and starts its timer.
2. Each part is received like a GEN_PUBLISH (``StoreOps.receive_parts``: capacity reserved before
   a byte is kept, chunk checksums computed here from the verified bytes) and held, reservation
   and all, in the transaction; its answer is parked (the connection goes on serving its other
   frames) until the transaction ends.
3. When the last of ``count`` parts is in, the parts' reservations are merged (names disjoint
   across parts, else the whole transaction is refused) and published as one generation (written
   to the data directory first, when there is one: ``Generations.publish_durable``; from here
   nothing aborts it, not its timer, not a part's connection closing); every parked part is
   answered with it.
4. Otherwise it is aborted: its timer runs out (``WaitTimeout``), a part fails or collides, or a
   connection that sent (or is sending) one of its parts closes (``PublishAborted``; over gRPC,
   a PublishPart call that ends before the transaction does: ``owner``). Every
   reservation is freed and every parked part answered with the error, which says how many of how
   many parts arrived. Nothing of it was ever visible. Its id is remembered a while, so that a
   part arriving late gets the same error at once.

Who may speak for a transaction: its 16-byte id is its credential. The ranks of one job share it
(rank 0 draws it at random and sends it to the others over their own process group); a part, and
so the commit its arrival may bring, or the abort its failure or its connection's end brings, is
taken only with the whole id, and only for the prefix it was opened under. The server never shows
it: errors and logs name a transaction by a hash of its id, so nothing they reach lets another
client join or abort it. A part with a head that disagrees with the transaction's (its count) is
refused without touching it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from tensorwire.errors import (
    CorruptFrame,
    InvalidName,
    LimitExceeded,
    ProtocolError,
    PublishAborted,
    ServerError,
    TensorwireError,
    WaitTimeout,
)
from tensorwire.server.request import Request
from tensorwire.server.store_ops import Parts, StoreOps, cpu
from tensorwire.store import Reservation
from tensorwire.store.generations import Generations, check_names
from tensorwire.store.uploads import client_of
from tensorwire.types import Generation
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm

_ABORTED_KEPT = 1024  # aborted transaction ids remembered
_OFF_LOOP_BYTES = 8 << 20  # checksums of a larger part are computed on a worker thread
# Publishes a merged reservation (its chunk checksums given; it owns it from there), durably where
# there is a data directory, and wakes the prefix's waiters.
Announce = Callable[[str, Reservation, Sequence[tuple[int, ...]]], Awaitable[Generation]]


@dataclass(eq=False)
class _Txn:
    prefix: str
    txn: bytes
    count: int
    timer: asyncio.TimerHandle | None = None
    parts: dict[int, tuple[Reservation, list[tuple[int, ...]]]] = field(default_factory=dict)
    receiving: set[int] = field(default_factory=set)  # indices whose frames are arriving
    owners: dict[_PartsHeld, set[int]] = field(default_factory=dict)  # connection -> its parts
    clients: set[str] = field(default_factory=set)  # client hosts with a part in it
    names: set[str] = field(default_factory=set)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    committing: asyncio.Task[None] | None = None  # its last part is in: being published
    generation: Generation | None = None
    error: TensorwireError | None = None

    def describe(self) -> str:
        # A hash, not the id: errors and logs must not hand out a transaction's credential.
        tag = hashlib.blake2b(self.txn, digest_size=6, person=b"tensorwire-txn").hexdigest()
        return f"transaction #{tag} of {self.prefix!r}"

    def arrived(self) -> str:
        return f"{len(self.parts)} of {self.count} parts arrived"


@dataclass(eq=False)
class _PartsHeld:
    """One connection's stake: the transactions it sent parts of, and its parked answers."""

    txns: set[_Txn] = field(default_factory=set)
    heads: dict[int, tuple[wg.PartHead, _Txn]] = field(default_factory=dict)  # request id -> part arriving
    answers: set[asyncio.Task[None]] = field(default_factory=set)
    on_close: Callable[[_PartsHeld], None] | None = None
    sender: str = "connection"  # what sent its parts, as the abort at its close names it
    client: str = ""  # its client host (``client_of``), whose quota its transactions count against

    def close(self) -> None:
        if self.on_close is not None:
            self.on_close(self)


class PartPublishes:
    """The open multi-part publishes of one server (module docstring)."""

    def __init__(
        self, generations: Generations, store_ops: StoreOps, announce: Announce, *, max_wait: float
    ) -> None:
        self.generations = generations
        self.store_ops = store_ops
        self.store = generations.store
        self.announce = announce
        self.config = generations.config
        self.max_wait = min(max_wait, self.config.max_wait_seconds)
        self.open: dict[tuple[str, bytes], _Txn] = {}
        self._client_txns: Counter[str] = Counter()  # open transactions with a part from each host
        # Recently aborted transactions, so that a part arriving late is refused with the reason
        # at once rather than opening the transaction again (bounded: the oldest are forgotten).
        self.aborted: OrderedDict[tuple[str, bytes], TensorwireError] = OrderedDict()

    def _held(self, req: Request) -> _PartsHeld:
        held = req.session_state(_PartsHeld)
        if held.on_close is None:
            held.on_close = self._connection_closed
            held.client = client_of(req.peer)
        return held

    async def publish_part(self, req: Request) -> None:
        held = self._held(req)
        head = functools.partial(self._head, held, req.header.request_id)
        await self.store_ops.receive_parts(req, functools.partial(self._received, held), head)

    # -- receiving a part -----------------------------------------------------------------------
    async def publish_reserved(
        self, req: Request, head: wg.PartHead, res: Reservation, sums: Sequence[tuple[int, ...]]
    ) -> None:
        """A part whose bytes are in ``res`` already (SHM_GEN_PART: an SHM_PUT's segments, written
        by the client, and its inline tensors, received and verified), with the chunk checksums
        the client says they have: it counts only if every chunk checksum computed here from the
        bytes matches. Owns ``res`` from here (freed on any refusal)."""
        held = self._held(req)
        parts = Parts(req.header.request_id, self.store, res, expected=list(sums))
        try:
            self._begin(held, req.header.request_id, head, parts)
        except TensorwireError as exc:
            parts.error = exc
        await self._received(held, req, parts)

    def _head(self, held: _PartsHeld, rid: int, reader: wm.MetaReader, parts: Parts) -> None:
        self._begin(held, rid, wg.decode_part_head(reader), parts)

    def _begin(self, held: _PartsHeld, rid: int, head: wg.PartHead, parts: Parts) -> None:
        if parts.head is None:  # the part's first frame: before a byte of it is reserved
            held.heads[rid] = head, self._open(held, head)
            parts.head = head.prefix
        elif rid not in held.heads or held.heads[rid][0] != head:
            raise ProtocolError(f"the frames of one GEN_PUBLISH_PART disagree on its head: {head}")

    def _open(self, held: _PartsHeld, head: wg.PartHead) -> _Txn:
        """Join (or open) ``head``'s transaction, within every bound, or raise."""
        key = (head.prefix, head.txn)
        if key in self.aborted:
            raise self.aborted[key]
        txn = self.open.get(key)
        limits = self.config
        if txn not in held.txns and len(held.txns) >= limits.transactions_per_owner:
            have = f"this connection has parts in {len(held.txns)} multi-part publishes"
            raise LimitExceeded(f"{have}: {limits.most('transactions_per_owner')}")
        joins = txn is None or held.client not in txn.clients
        if joins and self._client_txns[held.client] >= limits.transactions_per_client:
            have = f"this client ({held.client}) has parts in {self._client_txns[held.client]} publishes"
            raise LimitExceeded(f"{have}: {limits.most('transactions_per_client')}")
        if txn is None:
            self.generations.admit(head.prefix, client=held.client)
            self._check_open(head)
            txn = self._start(head)
        if head.count != txn.count:
            raise ProtocolError(f"a part of {txn.describe()} says it has {head.count} parts, not {txn.count}")
        if head.index in txn.parts or head.index in txn.receiving:
            raise ProtocolError(f"part {head.index} of {txn.describe()} was sent twice")
        if txn.committing is not None:
            raise ProtocolError(f"{txn.describe()} has all its parts already")
        txn.receiving.add(head.index)
        txn.owners.setdefault(held, set()).add(head.index)
        if held.client not in txn.clients:
            txn.clients.add(held.client)
            self._client_txns[held.client] += 1
        held.txns.add(txn)
        return txn

    def _check_open(self, head: wg.PartHead) -> None:
        limits = self.config
        if head.count > limits.max_parts:
            raise LimitExceeded(f"a publish of {head.count} parts: {limits.most('max_parts')}")
        if head.timeout_ms / 1000 > self.max_wait:
            asked = head.timeout_ms / 1000
            raise LimitExceeded(
                f"a part waits at most {self.max_wait:.3g}s (the longest this server waits: half its"
                f" --idle-timeout, at most --max-wait-seconds), not {asked:.3g}s"
            )
        if not head.timeout_ms:
            raise ProtocolError("a multi-part publish needs a timeout")
        if len(self.open) >= limits.max_transactions:
            have = f"this server has open {len(self.open)} multi-part publishes"
            raise LimitExceeded(f"{have}: {limits.most('max_transactions')}")

    def _start(self, head: wg.PartHead) -> _Txn:
        txn = _Txn(head.prefix, head.txn, head.count)
        self.open[(head.prefix, head.txn)] = txn
        loop = asyncio.get_running_loop()
        timeout = head.timeout_ms / 1000
        txn.timer = loop.call_later(timeout, self._expire, txn, timeout)
        return txn

    def _expire(self, txn: _Txn, timeout: float) -> None:
        waited = f"{txn.describe()} timed out after {timeout:.3g}s: {txn.arrived()}"
        missing = sorted(set(range(txn.count)) - set(txn.parts))[:8]
        self._abort(txn, WaitTimeout(f"{waited} (missing: parts {missing})"))

    async def _received(self, held: _PartsHeld, req: Request, parts: Parts) -> None:
        """The last frame of a part is in: hold it in its transaction, then answer when it ends."""
        opened = held.heads.pop(req.header.request_id, None)
        if opened is None:  # its first frame was refused
            parts.abort()
            raise parts.error or ProtocolError("GEN_PUBLISH_PART carried no head")
        head, txn = opened
        with req.waiting():  # every byte is in: its checksums are the server's work, not the peer's
            await self.add(txn, head, parts.reservation, parts.error, expected=parts.expected)
        await self._answer_when_ended(held, req, txn)  # parked: the commit (a disk write) waits alone

    # -- the same, for a caller that is not a frame connection (gRPC's PublishPart) -------------
    def owner(self, sender: str, client: str = "") -> _PartsHeld:
        """A new stake (one gRPC call's, from ``client``, its host): ``join`` with it, and ``close``
        it when the call ends, which aborts every transaction it has a part in that has not ended
        (``sender`` names it in that error: "call", "connection")."""
        return _PartsHeld(on_close=self._connection_closed, sender=sender, client=client)

    def join(self, held: _PartsHeld, head: wg.PartHead) -> _Txn:
        """Join (or open) ``head``'s transaction before a byte of the part is reserved (every bound
        of the module docstring, step 1), or raise."""
        return self._open(held, head)

    async def add(
        self,
        txn: _Txn,
        head: wg.PartHead,
        res: Reservation,
        error: TensorwireError | None = None,
        *,
        expected: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        """Part ``head.index`` of ``txn`` is received into ``res`` (``error``: why receiving it
        failed; ``expected``: the chunk checksums the client says bytes it wrote itself have, as
        SHM_GEN_PART's segments): held in the transaction, which commits if this was its last part.
        Else ``res`` is freed, the transaction aborted, and the error every part hears raised."""
        txn.receiving.discard(head.index)
        try:
            sums = await self._check_part(txn, head, res, error, expected)
        except TensorwireError as exc:
            self.store.abort(res)
            self._abort(txn, _failed(txn, head.index, exc))
            if txn.error is None or txn.error is exc:
                raise
            raise txn.error from exc  # every part hears the same
        txn.parts[head.index] = (res, sums)
        txn.names |= res.names
        if len(txn.parts) == txn.count:  # in a task of its own: no part's end may cut it short
            txn.committing = asyncio.get_running_loop().create_task(self._commit(txn))

    async def outcome(self, txn: _Txn) -> Generation:
        """Once ``txn`` has ended: its generation, or the error that aborted it (raised)."""
        await txn.ended.wait()
        if txn.generation is None:
            assert txn.error is not None
            raise txn.error
        return txn.generation

    async def _check_part(
        self,
        txn: _Txn,
        head: wg.PartHead,
        res: Reservation,
        error: TensorwireError | None,
        expected: Sequence[tuple[int, ...]] | None,
    ) -> list[tuple[int, ...]]:
        if error is not None:
            raise error
        if txn.ended.is_set():  # aborted while this part was arriving
            raise txn.error or ProtocolError(f"{txn.describe()} has ended")
        if not res.metas:
            raise ProtocolError(f"part {head.index} of {txn.describe()} carried no tensors")
        check_names(txn.prefix, [m.name for m in res.metas])
        clash = sorted(txn.names & res.names)
        if clash:
            part = f"part {head.index} of {txn.describe()}"
            raise InvalidName(f"{part} names {clash[0]!r}, as another part does")
        big = res.nbytes >= _OFF_LOOP_BYTES
        sums = await cpu(big, lambda: [wg.chunk_checksums(b) for b in res.buffers])
        if txn.ended.is_set():  # aborted while its checksums were computed on a worker thread
            raise txn.error or ProtocolError(f"{txn.describe()} has ended")
        if expected is not None and list(expected) != sums:  # bytes that came through segments
            if len(expected) != len(sums):
                raise ProtocolError(f"{len(expected)} checksum lists for the {len(sums)} tensors of a part")
            bad = next(m.name for m, a, b in zip(res.metas, sums, expected, strict=True) if a != b)
            part = f"part {head.index} of {txn.describe()}"
            raise CorruptFrame(f"{part}: {bad!r} does not hold the bytes its checksums say")
        return sums

    # -- ending ---------------------------------------------------------------------------------
    async def _commit(self, txn: _Txn) -> None:
        if txn.timer is not None:
            txn.timer.cancel()  # every part is in: only the publish itself may fail now
        parts = [txn.parts[i] for i in range(txn.count)]
        try:
            merged = self.store.merge([res for res, _ in parts])
        except TensorwireError as exc:
            txn.committing = None
            self._abort(txn, _failed(txn, -1, exc))
            return
        txn.parts.clear()  # owned by ``merged`` now
        try:
            txn.generation = await self.announce(txn.prefix, merged, [s for _, ss in parts for s in ss])
        except TensorwireError as exc:  # publish freed ``merged``
            txn.error = _failed(txn, -1, exc)
        except asyncio.CancelledError:  # the server stops
            txn.error = PublishAborted(f"{txn.describe()} aborted: the server stopped during its commit")
            raise
        except Exception as exc:  # a fault of ours: every part hears of it, none waits forever
            txn.error = _failed(txn, -1, ServerError(f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            self._end(txn)

    def _abort(self, txn: _Txn, error: TensorwireError) -> None:
        if txn.ended.is_set() or txn.committing is not None:  # a commit under way ends it itself
            return
        for res, _ in txn.parts.values():
            self.store.abort(res)
        txn.error = error
        self.aborted[(txn.prefix, txn.txn)] = error
        while len(self.aborted) > _ABORTED_KEPT:
            self.aborted.popitem(last=False)
        self._end(txn)

    def _end(self, txn: _Txn) -> None:
        if txn.timer is not None:
            txn.timer.cancel()
        self.open.pop((txn.prefix, txn.txn), None)
        for held in txn.owners:
            held.txns.discard(txn)
        for client in txn.clients:
            self._client_txns[client] -= 1
            if self._client_txns[client] <= 0:
                del self._client_txns[client]
        txn.clients.clear()
        txn.ended.set()

    async def _answer_when_ended(self, held: _PartsHeld, req: Request, txn: _Txn) -> None:
        if txn.ended.is_set():
            await _answer(req, txn)
            return
        task = asyncio.get_running_loop().create_task(_answer_later(req, txn))  # parked
        held.answers.add(task)
        task.add_done_callback(held.answers.discard)

    def _connection_closed(self, held: _PartsHeld) -> None:
        for txn in list(held.txns):
            if not txn.ended.is_set():
                sent = ", ".join(str(i) for i in sorted(txn.owners.get(held, ())))
                why = f"{txn.describe()} aborted: the {held.sender} that sent its part {sent} closed"
                self._abort(txn, PublishAborted(f"{why} before the commit ({txn.arrived()})"))
        held.heads.clear()
        for task in list(held.answers):
            task.cancel()


def _failed(txn: _Txn, index: int, exc: TensorwireError) -> PublishAborted:
    which = f"part {index}" if index >= 0 else "its commit"
    return PublishAborted(f"{txn.describe()} aborted: {which} failed ({txn.arrived()}): {exc}")


async def _answer_later(req: Request, txn: _Txn) -> None:
    await txn.ended.wait()
    await _answer(req, txn)


async def _answer(req: Request, txn: _Txn) -> None:
    with contextlib.suppress(TensorwireError):  # the connection is gone: nobody to answer
        if txn.generation is not None:
            await req.reply(wg.encode_generation(txn.generation))
        else:
            assert txn.error is not None
            await req.reply_error(txn.error)
