"""One server of a parameter-server job as a worker sees it: ``ServerSlot``.

A slot is one entry of the worker's ``servers``: one server, or a replica set
``"tcp://a:1|tcp://b:2"`` whose members take over from each other (docs/protocol.md §13.5). It is
the one record of all the worker keeps per server: the shards placed there, this worker's clock on
it and the last push it acknowledged (the two move together), the connection to the replica in use
together with which replica that is (they change together, under one lock), and the heartbeat's
own connection with its count of missed beats.

``call`` is the worker's reconnect-and-failover loop, in one place: a request that fails on the
network is resent, the same bytes on a new connection, until it is answered or ``timeout`` has
passed; a broken connection or NOT_PRIMARY moves to the next replica first. A push resent this way
keeps its sequence number, so a server that applied it already only answers again (exactly once,
docs/protocol.md §13.2). A worker the server dropped (NOT_MEMBER, ``WorkerDropped``) is not
retried here: the worker rejoins (``Worker._recover``).

Lifecycle: the worker builds one slot per server (any thread), then on its event loop sends
requests through ``rpc`` (a ``PsChannel`` over ``call``; any number, concurrently), ``beat``s from
its heartbeat task, ``close_beat`` when that task ends, then ``leave`` and ``close`` once, last.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import NamedTuple

from tensorwire import transport as transports
from tensorwire._aio import Deadline
from tensorwire.client.retry import RetryPolicy, backoff, retrying
from tensorwire.errors import ConnectError, ConnectionLost, NotPrimary, TensorwireError
from tensorwire.ps.placement import Shard
from tensorwire.ps.worker.rpc import PsChannel, Sender
from tensorwire.transport.base import FrameChannel, Progress, Sink
from tensorwire.types import Address
from tensorwire.wire import meta as wm

log = logging.getLogger("tensorwire.ps.worker")  # the worker's log, as before the slots moved here
RETRY_CAP = 0.25  # seconds between resends at most
# Resend until the deadline, with short capped waits: during a failover the backup takes over at a
# moment this side cannot know, and each doubling past it would add to the pause.
_RESEND = RetryPolicy(retries=None, delay=backoff(0.1, RETRY_CAP, jitter=False))


class _Link(NamedTuple):
    """The replica in use (an index into ``replicas``) and the connection to it, if one is open."""

    at: int
    conn: FrameChannel | None = None


class ServerSlot:
    """One server (or replica set) of the job, as this worker sees it (see the module doc)."""

    def __init__(
        self,
        name: str,
        shards: Sequence[Shard],
        *,
        rank: int,
        sender: Sender,
        options: transports.TransportOptions,
        timeout: float,
    ) -> None:
        self.name = name  # as given: one URL, or replicas joined by "|"
        self.replicas = tuple(name.split("|"))
        self.shards = shards
        self.clock = 0  # this worker's clock on this server
        self.seq = 0  # the last push sequence number this server applied
        self.rank = rank
        self.rpc = PsChannel(self, sender, peer=name, label=f" from worker {rank} to {name}")
        self._options = options
        self._timeout = timeout
        # Requests go to the replica that answers as primary, and move on when it breaks or says
        # NOT_PRIMARY: which replica and the connection to it are one value, changed under the lock.
        self._link = _Link(0)
        self._reconnecting = asyncio.Lock()
        # The connection being opened under the lock, and to which replica: ``follow`` ends it when
        # the coordinator names another (a stopped process accepts a connection and never answers,
        # so the open would hold the lock, and the move, until its timeout).
        self._opening: tuple[int, asyncio.Task[FrameChannel]] | None = None
        self._beat: FrameChannel | None = None  # the heartbeat's own connection
        self._beat_for = ""  # the replica URL it was opened for
        self._missed = 0  # heartbeats missed in a row

    @property
    def url(self) -> str:
        """The replica in use."""
        return self.replicas[self._link.at]

    @property
    def conn(self) -> FrameChannel | None:
        """The connection to the replica in use, if one was opened (it may be closed since)."""
        return self._link.conn

    def joined(self, clock: int, seq: int) -> None:
        """A (re)join answered: this worker goes on from that clock and that last applied push."""
        self.clock, self.seq = clock, seq

    def acked(self, seq: int) -> None:
        """The server has push ``seq``: the next push is the one after it, at the next clock."""
        self.seq = seq
        self.clock += 1

    # -- requests ---------------------------------------------------------------------------------
    async def call(
        self,
        opcode: int,
        meta: bytes,
        data: Sequence[memoryview] = (),
        sink: Sink | None = None,
        *,
        what: str,
        timeout: float | None = None,
        progress: Progress | None = None,
    ) -> wm.MetaReader:
        """One request to this server (a ``FrameCaller``), resent on a new connection while the
        network fails (a broken connection, a server restarting), for at most ``timeout`` seconds."""

        tried = self._link.at  # the replica the last attempt went to

        async def connection() -> FrameChannel:
            nonlocal tried
            tried = self._link.at
            return await self._connection()

        async def attempt(conn: FrameChannel) -> wm.MetaReader:
            return await conn.call(opcode, meta, data, sink, what=what, timeout=timeout, progress=progress)

        async def failed(exc: TensorwireError) -> None:  # a broken connection, a corrupt chunk: resend
            log.info("%s failed (%s); retrying", what, exc)
            if isinstance(exc, (ConnectError, ConnectionLost, NotPrimary)):
                await self._next_replica(tried)

        deadline = Deadline.after(self._timeout, what)
        return await retrying(attempt, connection, _RESEND, deadline=deadline, on_retry=failed)

    async def _connection(self) -> FrameChannel:
        conn = self._link.conn
        if conn is not None and not conn.closed:
            return conn
        async with self._reconnecting:
            at, conn = self._link
            if conn is None or conn.closed:
                opening = asyncio.ensure_future(self._open(self.replicas[at], self._options))
                self._opening = (at, opening)
                try:
                    conn = await opening
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():  # this request was cancelled
                        raise
                    moved = f"{self.replicas[at]}: left for the primary the coordinator named"
                    raise ConnectError(moved) from None
                finally:
                    self._opening = None
                self._link = _Link(at, conn)
            return conn

    async def _next_replica(self, failed: int) -> None:
        """Move on from replica ``failed`` to the next one (a failover), if it has several and
        the link is still there (another request, or the coordinator's word, may have moved it:
        moving again would undo that)."""
        if len(self.replicas) < 2:
            return
        async with self._reconnecting:  # not while a connection to the old one is being opened
            at, conn = self._link
            if at != failed:
                return
            self._link = _Link((at + 1) % len(self.replicas))
            if conn is not None:
                await conn.close()
        log.info("worker %d moves to replica %s", self.rank, self.url)

    async def follow(self, address: str) -> bool:
        """The coordinator names ``address`` this server's primary: move there now, if it is one
        of its replicas and not the one in use (a request waiting on the old one fails and is
        resent there). Whether it moved."""
        index = _replica_index(self.replicas, address)
        if index is None:
            log.warning(
                "the coordinator names %s the primary of %s, which does not list it", address, self.name
            )
            return False
        if self._opening is not None and self._opening[0] != index:
            self._opening[1].cancel()
        async with self._reconnecting:
            at, conn = self._link
            if at == index:
                return False
            self._link = _Link(index)
            if conn is not None:
                await conn.close()
            if self._beat is not None:  # a heartbeat waiting on the old primary ends now too
                await self._beat.close()
        log.info("worker %d follows the coordinator to replica %s", self.rank, self.url)
        return True

    @staticmethod
    async def _open(url: str, options: transports.TransportOptions) -> FrameChannel:
        return await transports.open_channel(url, options, what="the parameter-server worker")

    # -- heartbeats -------------------------------------------------------------------------------
    async def beat(self, sender: Sender, incarnation: int, options: transports.TransportOptions) -> None:
        """One heartbeat, on a connection of its own (a pull waiting for a step must not hold it
        up); two missed in a row drop the request connection (``_abandon``)."""
        url = self.url
        try:
            conn = self._beat
            # Which replica it was opened for, not its address: prefer_local may have moved it to
            # that replica's shm:// listener.
            if conn is None or conn.closed or self._beat_for != url:
                if conn is not None:
                    await conn.close()
                conn = self._beat = await self._open(url, options)
                self._beat_for = url
            await PsChannel(conn, sender).heartbeat(self.clock, incarnation)
            self._missed = 0
        except TensorwireError as exc:
            log.debug("heartbeat to %s failed: %s", url, exc)
            if self.url != url:  # moved to another replica meanwhile: not a miss of that one
                return
            self._missed += 1
            if self._missed >= 2:  # the server is unreachable (cut off, gone without a reset)
                # Counted afresh: a worker that comes back to this replica (the others said
                # NOT_PRIMARY meanwhile) drops it again two misses later, not never.
                self._missed = 0
                await self._abandon()

    async def _abandon(self) -> None:
        """Drop the connection to a server that stopped answering heartbeats: a request waiting on
        it fails now and is resent (on the next replica, if any) instead of waiting out its timer."""
        conn = self._link.conn
        if conn is not None and not conn.closed:
            log.warning("worker %d: %s stopped answering heartbeats; dropping its connection", self.rank,
                        self.url)  # fmt: skip
            await conn.close()

    async def close_beat(self) -> None:
        if self._beat is not None:
            await self._beat.close()

    # -- the end ----------------------------------------------------------------------------------
    async def leave(self, sender: Sender, incarnation: int, timeout: float) -> None:
        """PS_LEAVE on the connection open now, if there is one: no retries, no new connection
        (the process may be ending)."""
        conn = self._link.conn
        if conn is not None and not conn.closed:
            await PsChannel(conn, sender).leave(0, incarnation, timeout=timeout)

    async def close(self) -> None:
        if self._link.conn is not None:
            await self._link.conn.close()


def _replica_index(replicas: Sequence[str], address: str) -> int | None:
    """Which of ``replicas`` is ``address`` (compared as parsed addresses: "host:port" and
    "tcp://host:port" are one), if any."""
    wanted = _canonical(address)
    for index, replica in enumerate(replicas):
        if _canonical(replica) == wanted:
            return index
    return None


def _canonical(url: str) -> str:
    try:
        return str(Address.parse(url))
    except ValueError:
        return url
