"""Primary/backup replication of a parameter server's job.

A primary (``tensorwire ps serve --backup URL``) sends every change of its job's state to its
backups, in the order it makes them, and waits for each backup to apply it before it makes the
change itself and answers the worker: a job created, a worker joining, leaving or dropped, a push
received (with its gradient bytes), a pull noted (async/ssp staleness), a rollback. Backups run
the same code on the same inputs in the same order, so their parameters, optimizer state, clocks
and push marks stay bit-identical, and an acknowledged push is on every live replica.

A backup (``--standby``) serves no worker. When a worker asks it and its primary has sent nothing
(not even its twice-a-second ping) for ``failover_timeout`` seconds, it takes over under a new
epoch. A primary that comes back, or was only cut off, is fenced: its next replication frame
carries the old epoch, the backup refuses it, and the old primary steps down (it answers
NOT_PRIMARY from then on), so no two primaries acknowledge pushes. Workers list the replicas of
each server (``tcp://a:7070|tcp://b:7070``) and move to the next one on a broken connection or
NOT_PRIMARY, resending what was not acknowledged (exactly once, by sequence number).

A backup that is new, restarted or was lost gets the whole job first (SYNC), at the primary's
next change or ping. A replica that hears from a primary of a newer epoch follows it: an old
primary that was only slow or stopped becomes that primary's backup (refusing would fence both).
A backup that stops answering is given up on after the primary's replication timeout (the larger
of 5 s and 4 x ``failover_timeout``) and retried at each ping; until then it holds up the changes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import struct
import time
from collections.abc import Callable, Sequence

from tensorwire import transport as transports
from tensorwire.errors import NotPrimary, TensorwireError
from tensorwire.transport.framed import FramedTransport
from tensorwire.types import Address
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

log = logging.getLogger("tensorwire.ps.replication")
Sync = Callable[[], "tuple[bytes, list[memoryview]] | None"]  # the state transfer, or None (no job)
PING_SECONDS = 0.5
_KIND = struct.Struct("<BQ")  # kind, epoch


class Change(enum.IntEnum):
    """What a PS_REPLICATE frame carries (after the head: u8 kind, u64 epoch, then the body)."""

    PING = 0
    CREATE = 1  # body: config, records; data: the values
    JOIN = 2
    LEAVE = 3
    PUSH = 4  # body: records; data: the gradients
    DROP = 5
    READ = 6  # head.clock: the read clock to note
    ROLLBACK = 7  # head.clock: the version
    SYNC = 8  # body: u32 length + JSON state, records; data: params, optimizer, pending pushes


def encode(change: Change, epoch: int, head: wps.PsHead, body: bytes = b"") -> bytes:
    return head.encode() + _KIND.pack(change, epoch) + body


def decode(reader: wm.MetaReader) -> tuple[wps.PsHead, Change, int]:
    head = wps.PsHead.decode(reader)
    kind, epoch = reader.take(_KIND)
    try:
        return head, Change(kind), epoch
    except ValueError:
        raise NotPrimary(f"unknown replication change {kind}") from None


class Backups:
    """The primary's side: one connection per backup, changes sent to all, in order."""

    def __init__(self, urls: Sequence[str], connect_timeout: float = 5.0, timeout: float = 60.0) -> None:
        self.urls = list(urls)
        self._options = transports.TransportOptions(connect_timeout, timeout)
        self._conns: dict[str, FramedTransport] = {}
        self.lost: set[str] = set()  # backups that stopped answering: no longer waited for
        self._synced: set[str] = set()  # backups holding the job (after a state transfer)
        # For metrics: when each backup last applied a change, and how many changes a lost one missed.
        self.acked: dict[str, float] = {}
        self.behind: dict[str, int] = dict.fromkeys(self.urls, 0)

    def reset(self) -> None:
        """Forget every backup's state (this server just became the primary)."""
        self.lost.clear()
        self._synced.clear()

    async def send(self, meta: bytes, data: Sequence[memoryview] = (), sync: Sync | None = None, *,
                   retry_lost: bool = False) -> None:  # fmt: skip
        """Apply a change on every live backup (``retry_lost``: also on those lost, which get the
        whole job first, from ``sync``); NotPrimary if one of them has a newer epoch."""
        live = [url for url in self.urls if retry_lost or url not in self.lost]
        for url in self.lost.difference(live):
            self.behind[url] += 1
        sends = (self._send_one(url, meta, data, sync) for url in live)
        results = await asyncio.gather(*sends, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _send_one(self, url: str, meta: bytes, data: Sequence[memoryview], sync: Sync | None) -> None:
        try:
            conn = self._conns.get(url)
            if conn is None or conn.closed:
                self._synced.discard(url)  # a new connection may be a restarted, empty backup
                opened = await transports.open_transport(Address.parse(url), self._options)
                assert isinstance(opened, FramedTransport)
                conn = self._conns[url] = opened
            if url not in self._synced:
                transfer = sync() if sync is not None else None
                if transfer is not None:
                    (
                        await conn.call(Opcode.PS_REPLICATE, *transfer, what=f"the state transfer to {url}")
                    ).done()
                    log.info("backup %s has the job (state transfer)", url)
                self._synced.add(url)
            reader = await conn.call(Opcode.PS_REPLICATE, meta, data, what=f"a replicated change to {url}")
            reader.done()
            self.lost.discard(url)
            self.acked[url], self.behind[url] = time.monotonic(), 0  # a state transfer caught it up
        except NotPrimary:
            raise
        except TensorwireError as exc:
            # A dead backup must not stop training: go on with the others (fewer copies).
            if url not in self.lost:
                log.warning("backup %s lost (%s): going on without it", url, exc)
            self.lost.add(url)
            self._synced.discard(url)
            self.behind[url] += 1

    async def close(self) -> None:
        for conn in self._conns.values():
            await conn.close()
        self._conns.clear()
