"""Primary/backup replication of a parameter server's jobs.

A primary (``tensorwire ps serve --backup URL``) sends every change of its jobs' state to its
backups, in the order it makes them, and waits for each backup to apply it before it makes the
change itself and answers the worker: a job created or ended, a worker joining, leaving or
dropped, a push received (with its gradient bytes), a pull noted (async/ssp staleness), a
barrier reached, a rollback. Each change's head names its job (the worker request's head, job id
included). Backups run the same code on the same inputs in the same order, so their parameters,
optimizer state, clocks and push marks stay bit-identical, and an acknowledged push is on every
live replica. Replication is the server process's, not a job's: one role, one epoch, one set of
backups, one order of changes for all its jobs.

This module is the wire of it (``Change``, ``encode``, ``decode``) and the primary's connections
to its backups (``Backups``); ps/server/replica.py is a replica's own side: its role and epoch, the
order of changes, promotion, fencing and PS_REPLICATE.

A backup (``--standby``) serves no worker. When a worker asks it and its primary has sent nothing
(not even its twice-a-second ping) for ``failover_timeout`` seconds, it takes over under a new
epoch. A primary that comes back, or was only cut off, is fenced: its next replication frame
carries the old epoch, the backup refuses it, and the old primary steps down (it answers
NOT_PRIMARY from then on), so no two primaries acknowledge pushes. Workers list the replicas of
each server (``tcp://a:7070|tcp://b:7070``) and move to the next one on a broken connection or
NOT_PRIMARY, resending what was not acknowledged (exactly once, by sequence number).

A backup that is new, restarted or was lost gets every job first (SYNC), at the primary's
next change or ping. A replica that hears from a primary of a newer epoch follows it: an old
primary that was only slow or stopped becomes that primary's backup (refusing would fence both).
A backup that stops answering is given up on after the primary's replication timeout (the larger
of 5 s and 4 x ``failover_timeout``); until then it holds up the changes. A lost backup is
reconnected in the background, outside the order of changes (a silent host costs a connect
timeout there, not a stall of every change), and the next ping sends it the job and takes it back.

Who may replicate: the replicas of one slot share a peer token (``ps serve --peer-token-file``,
distinct from the clients' token). A primary opens its connections to its backups with it (and
with its peer TLS files for ``tls://`` backups); a server serves PS_REPLICATE only on a connection
whose HELLO offered it (a peer session), so an ordinary client can neither demote nor fence a
primary. Epochs are in ``1 .. MAX_EPOCH - 1``; anything else is refused before a state changes.

What a primary does when it cannot replicate to a backup:

* the backup is down (refused connection, broken link, timeout): today's trade, training goes on
  with fewer copies, but never silently: a warning when it is lost, ``tensorwire_ps_backup_up``
  0 and ``..._behind_changes`` counting, ``LOST`` in ``tensorwire status``; it is retried at each
  ping and brought back by a state transfer;
* the backup runs on the primary's host (its HELLO's host label or host identity is the
  primary's): it takes every change, but a host failure loses both; a warning once,
  ``tensorwire_ps_backup_same_host`` 1 and ``same_host`` in STATUS;
* the backup refuses the primary's peer credentials (AuthenticationError: a wrong peer token, a
  TLS certificate that does not verify): a configuration error, which no wait cures. The change
  is not made and the worker gets ``ReplicationRefused`` naming the backup and why, an error is
  logged, ``tensorwire_ps_backup_refused`` is 1 and status shows ``REFUSED``. Acknowledging with
  fewer copies would hide, until the next failover loses the job, that the backup never had one.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tensorwire import topology
from tensorwire import transport as transports
from tensorwire._aio import cancel_and_wait
from tensorwire.errors import (
    AuthenticationError,
    NotPrimary,
    ProtocolError,
    ReplicationRefused,
    TensorwireError,
    UnsupportedTransport,
)
from tensorwire.logs import event
from tensorwire.security import Security
from tensorwire.transport.base import FrameChannel
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire import shm as ws
from tensorwire.wire.frame import Opcode

log = logging.getLogger("tensorwire.ps.replication")
Sync = Callable[[], "tuple[bytes, list[memoryview]] | None"]  # the state transfer
PING_SECONDS = 0.5
# Epochs a replica accepts: a u64 on the wire, bounded far below its top so that a promotion
# (epoch + 1) can never overflow, whatever a peer sent.
MAX_EPOCH = 1 << 62
_KIND = struct.Struct("<BQ")  # kind, epoch


class Change(enum.IntEnum):
    """What a PS_REPLICATE frame carries (after the head: u8 kind, u64 epoch, then the body)."""

    PING = 0
    CREATE = 1  # body: config, records; data: the values
    JOIN = 2  # body: [the job's owner] (``encode_owner``)
    LEAVE = 3  # body: u8 final (the worker is done: the job may end)
    PUSH = 4  # body: records; data: the gradients
    DROP = 5
    READ = 6  # head.clock: the read clock to note
    ROLLBACK = 7  # head.clock: the version
    SYNC = 8  # body: u32 length + JSON state, records; data: every job's params, optimizer, pushes
    END = 9  # body: u8 force (tensorwire ps end)
    BARRIER = 10  # head.clock: the barrier generation the worker reached


def encode(change: Change, epoch: int, head: wps.PsHead, body: bytes = b"") -> bytes:
    return head.encode() + _KIND.pack(change, epoch) + body


def decode(reader: wm.MetaReader) -> tuple[wps.PsHead, Change, int]:
    """The head, change and epoch of a PS_REPLICATE frame; ProtocolError for an unknown change or
    an epoch out of range (never NotPrimary: that answer fences the sender)."""
    head = wps.PsHead.decode(reader)
    kind, epoch = reader.take(_KIND)
    check_epoch(epoch)
    try:
        return head, Change(kind), epoch
    except ValueError:
        raise ProtocolError(f"unknown replication change {kind}") from None


_OWNER_KINDS = {0: None, 1: b""}  # not claimed yet, open; 2: a 32-byte token digest follows


def encode_owner(owner: bytes | None) -> bytes:
    """A job's owner (ps/job.py ``Job.owner``), with its JOIN: ``u8 kind | [32-byte digest]``."""
    if owner is None:
        return b"\x00"
    return b"\x01" if not owner else b"\x02" + owner


def decode_owner(reader: wm.MetaReader) -> bytes | None:
    """The owner a JOIN carries (None: not said, or not claimed yet)."""
    if not reader.remaining:
        return None
    kind = reader.raw(1)[0]
    if kind in _OWNER_KINDS:
        return _OWNER_KINDS[kind]
    if kind != 2:
        raise ProtocolError(f"unknown job owner kind {kind}")
    return reader.raw(32)


def check_epoch(epoch: int) -> None:
    if not 1 <= epoch < MAX_EPOCH:
        raise ProtocolError(f"epoch {epoch} is out of range (1 .. {MAX_EPOCH - 1})")


@dataclass(eq=False)
class Backup:
    """What the primary knows of one backup."""

    url: str
    conn: FrameChannel | None = None
    synced: bool = False  # holds the job (after a state transfer)
    lost: bool = False  # stopped answering: no longer waited for
    refused: str | None = None  # why it refuses this primary's peer credentials (a config error)
    acked: float | None = None  # when (monotonic) it last applied a change
    behind: int = 0  # changes it missed while lost
    reconnecting: asyncio.Task[None] | None = None  # while lost: a connection being opened
    same_host: str | None = None  # the host it shares with this primary (its HELLO says), if it does

    @property
    def connected(self) -> bool:
        return self.conn is not None and not self.conn.closed


class Backups:
    """The primary's side: one connection per backup, changes sent to all, in order."""

    def __init__(
        self, urls: Sequence[str], peer: Security, connect_timeout: float = 5.0, timeout: float = 60.0
    ) -> None:
        if not peer.token:
            raise ValueError("replication needs a peer token (ps serve --peer-token-file)")
        self.urls = list(urls)
        self.backups = {url: Backup(url) for url in self.urls}
        # The peer token (and peer TLS files) open the connections: a backup serves PS_REPLICATE
        # only to a session whose HELLO offered the slot's peer token.
        self._options = transports.TransportOptions(connect_timeout, timeout, security=peer)
        self.refusals = 0  # changes not made because a backup refused the peer credentials
        # Where this primary runs, to tell a backup on its own host (a host failure loses both).
        self._host = topology.here().host
        self._host_id = topology.host_identity(ws.shm_dir())

    def reset(self, previous: str | None = None) -> None:
        """Forget every backup's state (this server just became the primary): the next change
        goes to each and waits for it (up to the connect timeout for one that accepts and never
        answers: a stopped process). Except ``previous``, the primary whose lease a coordinator
        let pass to this one: it may be just that, so it starts lost and the pings take it back
        in the background (the coordinator's in-sync set, written before a change is
        acknowledged, says which copies there are). Without a coordinator there is none: the
        first change must reach the old primary, which is what fences it if it is alive."""
        for backup in self.backups.values():
            backup.lost = backup.synced = False
            if backup.url == previous:
                self._lost(backup, "the primary before this one: taken back by the pings", missed=False)

    async def send(
        self, meta: bytes, data: Sequence[memoryview] = (), sync: Sync | None = None, *, ping: bool = False
    ) -> None:
        """Apply a change on every live backup (a ``ping`` changes nothing; it also takes back the
        lost ones reconnected meanwhile, which get the whole job first, from ``sync``, and starts
        reconnecting the others). NotPrimary if one of them has a newer epoch; ReplicationRefused
        if one refuses this primary's peer credentials: the change is then not made here, so the
        backups that applied it get the whole job again first."""
        live = [b for b in self.backups.values() if not b.lost or (ping and b.connected)]
        for backup in self.backups.values():
            if backup in live:
                continue
            if ping:
                self._reconnect(backup)
            else:
                backup.behind += 1
        sends = (self._send_one(backup, meta, data, sync, ping) for backup in live)
        results = await asyncio.gather(*sends, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return
        if not ping:  # some backups may hold a change that is not made here: bring them back in step
            for backup in live:
                backup.synced = False
        raise next((e for e in errors if isinstance(e, NotPrimary)), errors[0])

    async def _send_one(
        self, backup: Backup, meta: bytes, data: Sequence[memoryview], sync: Sync | None, ping: bool
    ) -> None:
        url = backup.url
        try:
            conn = backup.conn
            if conn is None or conn.closed:
                backup.synced = False  # a new connection may be a restarted, empty backup
                conn = backup.conn = await self._open(backup)
            if not backup.synced:
                transfer = sync() if sync is not None else None
                if transfer is not None:
                    (
                        await conn.call(Opcode.PS_REPLICATE, *transfer, what=f"the state transfer to {url}")
                    ).done()
                    log.info("backup %s has the job (state transfer)", url)
                backup.synced = True
            reader = await conn.call(Opcode.PS_REPLICATE, meta, data, what=f"a replicated change to {url}")
            reader.done()
        except NotPrimary:
            raise
        except AuthenticationError as exc:
            raise await self._refused(backup, exc) from exc
        except TensorwireError as exc:
            self._lost(backup, exc, missed=not ping)
            return
        if backup.lost or backup.refused:
            event(log, logging.WARNING, "backup back", backup=url, missed=backup.behind)
        backup.lost, backup.refused = False, None
        backup.acked, backup.behind = time.monotonic(), 0  # a state transfer caught it up

    async def _open(self, backup: Backup) -> FrameChannel:
        try:
            what = f"replication to {backup.url}"
            conn = await transports.open_channel(backup.url, self._options, what=what)
        except UnsupportedTransport as exc:  # a configuration error, as refused credentials are
            raise AuthenticationError(str(exc)) from exc
        self._check_host(backup, conn.info.where)
        return conn

    def _check_host(self, backup: Backup, where: wm.Whereabouts | None) -> None:
        """A backup on this primary's host (same host label or host identity, as its HELLO says)
        keeps no copy through a host failure: a weakened guarantee, warned once and shown
        (``tensorwire_ps_backup_same_host``, STATUS). A backup that does not say is not judged."""
        same = where is not None and (where.host == self._host or where.host_id == self._host_id)
        if same and backup.same_host is None:
            event(log, logging.WARNING, "backup on the primary's host: a host failure loses both",
                  backup=backup.url, host=where.host if where else None)  # fmt: skip
        backup.same_host = where.host if same and where is not None else None

    def _reconnect(self, backup: Backup) -> None:
        """Open a lost backup's connection in the background; the next ping takes it back."""
        if backup.reconnecting is None or backup.reconnecting.done():
            backup.reconnecting = asyncio.get_running_loop().create_task(self._reconnecting(backup))

    async def _reconnecting(self, backup: Backup) -> None:
        try:
            conn = await self._open(backup)
        except AuthenticationError as exc:  # back, but refusing us: changes will try it (and fail)
            self._note_refusal(backup, str(exc))
            backup.lost = False
        except TensorwireError:
            pass  # still down: the next ping tries again
        else:
            if backup.connected or not backup.lost:  # taken back meanwhile (reset): keep the one it has
                await conn.close()
                return
            backup.conn, backup.synced = conn, False

    def _lost(self, backup: Backup, exc: TensorwireError | str, *, missed: bool) -> None:
        """A dead backup must not stop training: go on with the others (fewer copies), visibly."""
        if not backup.lost:
            event(log, logging.WARNING, "backup lost: going on with fewer copies", backup=backup.url,
                  error=str(exc))  # fmt: skip
        backup.lost, backup.synced = True, False
        backup.behind += missed

    def _note_refusal(self, backup: Backup, why: str) -> None:
        if backup.refused != why:
            event(log, logging.ERROR, "backup refuses this primary's peer credentials: changes refused",
                  backup=backup.url, error=why)  # fmt: skip
        backup.refused, backup.synced = why, False

    async def _refused(self, backup: Backup, exc: AuthenticationError) -> ReplicationRefused:
        """The backup refuses this primary's credentials: an error, for the worker and the operator."""
        why = str(exc)
        self._note_refusal(backup, why)
        self.refusals += 1
        if backup.conn is not None:  # the next try opens a new one (the backup may be fixed by then)
            await backup.conn.close()
            backup.conn = None
        return ReplicationRefused(
            f"backup {backup.url} refuses this primary's peer credentials ({why}), so the change was "
            "not made: give every replica of the slot the same --peer-token-file (and, for tls:// "
            "backups, --peer-tls-ca/--peer-tls-cert that it accepts)"
        )

    async def close(self) -> None:
        for backup in self.backups.values():
            await cancel_and_wait(backup.reconnecting)
            backup.reconnecting = None
            if backup.conn is not None:
                await backup.conn.close()
                backup.conn = None
