"""This parameter server's place in its replica set: its role and epoch, the order in which changes
are replicated and made, promotion and fencing, and the backup's side of PS_REPLICATE.

One ``Replica`` per server process, whatever the number of jobs it holds: the replicas of a slot
fail over together, and the changes of all its jobs are made in one order (each change's head
names its job), so a state transfer taken between two changes holds every job as it is.

ps/server/replication.py is the wire (``Change``, ``encode``/``decode``) and the primary's connections
to its backups (``Backups``); its module doc tells the whole scheme. Here:

* ``in_order``: every change of the job is made one at a time, and replicated inside the same
  turn before it is made here (``replicate``): an acknowledged change is on every live backup.
* ``serving``: a worker's request is refused (NOT_PRIMARY) unless this replica is the primary; a
  backup whose primary has been silent for ``failover_timeout`` takes over first (``_promote``).
  A primary pings its backups twice a second while it serves. With a coordinator
  (``ps serve --coordinator``, ps/server/leadership.py) the lease decides instead: every replica
  starts as a backup, the lease holder is the primary at the coordinator's epoch (``take_over``),
  it serves only while its term holds and steps down when it ends (``step_down``), and it writes
  the slot's in-sync set before it acknowledges a change without a backup that was in it.
* ``replicate``: a backup refusing a change with a newer epoch fences this primary (role
  ``fenced``: it answers NOT_PRIMARY from then on). A backup that is new, or back, first gets
  every job (the SYNC state transfer, from the ``Holder``: ps/server/jobs.py).
* ``on_replicate``: a backup checks that a change comes from a replica of its slot (a peer
  session) under an epoch in range, follows a newer primary, takes a state transfer itself and
  hands every other change to the server to make, exactly as the primary made it.

Lifecycle: made with the server (``standby`` or a coordinator: a backup at epoch 0; else the
primary at epoch 1), then given what holds the jobs (``hold``); ``lead`` starts the leadership
(with a coordinator) once the server listens; the first request served starts the pings;
``close`` stops them, resigns a term held and closes the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NoReturn, Protocol

import torch

from tensorwire._aio import cancel_and_wait
from tensorwire.errors import (
    AuthenticationError,
    InvalidTensor,
    NotPrimary,
    ProtocolError,
    ReplicationRefused,
    TensorwireError,
)
from tensorwire.logs import event
from tensorwire.ps.server import replication
from tensorwire.ps.server.leadership import Leadership
from tensorwire.security import Security
from tensorwire.server.core import Request
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.tensors import byte_view

log = logging.getLogger("tensorwire.ps")
# A change for the server to make, as a backup: (what, the worker's head, the request with its body).
Apply = Callable[[replication.Change, wps.PsHead, Request], Awaitable[None]]


class Holder(Protocol):
    """What holds the server's jobs, as the replica needs it (ps/server/jobs.py ``Jobs``)."""

    def take_all(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Every job's state (JSON-able) and tensors, for a state transfer (SYNC)."""
        ...

    async def load_all(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Make a state transfer the server's jobs (those it does not name end)."""
        ...

    def promoted(self) -> None:
        """This backup became the primary: its workers get a grace period to move over."""
        ...

    def describe(self) -> str:
        """A few words on the jobs, for the log."""
        ...


class Replica:
    """Role, epoch and the order of changes of one replica (see the module doc)."""

    def __init__(
        self,
        backups: Sequence[str],
        peer: Security | None,
        *,
        standby: bool,
        failover_timeout: float,
        leadership: Leadership | None = None,
    ) -> None:
        # With a coordinator every replica starts as a backup: the lease makes one the primary.
        self.leadership = leadership
        self.role = "backup" if standby or leadership is not None else "primary"
        self.epoch = 0 if self.role == "backup" else 1
        self.failover_timeout = failover_timeout
        self.failovers = 0
        # How this replica reaches the others of its slot, and what they must offer it: the peer
        # token (and TLS files for tls:// peers). Without one any client could demote or fence it.
        self.peer = peer or Security()
        if (backups or standby) and not self.peer.token:
            raise ValueError(
                "a replicated parameter server (backups or standby) needs a peer token shared by "
                "its slot's replicas (ps serve --peer-token-file; ParamServer(peer=Security(token=...)))"
            )
        self.replicate_refused: Counter[str] = Counter()  # PS_REPLICATE frames refused, by reason
        # A backup that stops answering (stopped, cut off) holds up every change until it is given
        # up on; long enough for a state transfer, short next to a worker's timeout.
        replicate_timeout = max(5.0, 4 * failover_timeout)
        self._backups = (
            replication.Backups(backups, self.peer, timeout=replicate_timeout) if backups else None
        )
        self._holder: Holder | None = None
        self._ordered: asyncio.Lock | None = None  # changes are made (and replicated) one at a time
        self._primary_seen: float | None = None
        self._pinging: asyncio.Task[None] | None = None

    @property
    def backups(self) -> replication.Backups | None:
        return self._backups

    def hold(self, holder: Holder) -> None:
        """What holds the jobs: state transfers take and load them, a promotion tells it."""
        self._holder = holder

    @property
    def holder(self) -> Holder:
        assert self._holder is not None, "Replica.hold was not called"
        return self._holder

    def is_peer(self, address: str) -> bool:
        """Whether ``address`` is one of the replicas this one was given (``--backup``): the only
        addresses it offers the slot's peer credentials to."""
        return self._backups is not None and address in self._backups.urls

    @property
    def primary_seen(self) -> float | None:
        """When (monotonic) a backup last heard from its primary."""
        return self._primary_seen

    def in_order(self) -> asyncio.Lock:
        if self._ordered is None:
            self._ordered = asyncio.Lock()
        return self._ordered

    # -- the primary ----------------------------------------------------------------------------
    def serving(self) -> None:
        """Refuse a worker's request unless this replica is the primary. A backup whose primary has
        been silent for ``failover_timeout`` takes over first (without a coordinator)."""
        if self.leadership is not None:
            self._serving_by_lease(self.leadership)
            return
        if self.role == "primary":
            self._start_pings()
            return
        seen = self._primary_seen
        if self.role == "backup" and seen is not None and time.monotonic() - seen > self.failover_timeout:
            self._promote()
            return
        raise NotPrimary(f"this replica is a {self.role} at epoch {self.epoch}: ask another one")

    def _start_pings(self) -> None:
        if self._backups is not None and not self._pings_running():
            self._pinging = asyncio.get_running_loop().create_task(self._ping_backups())

    def _pings_running(self) -> bool:
        # The loop ends when this replica stops being the primary: a primary again (a term won
        # back after a step-down, a takeover after following another) must start it again.
        return self._pinging is not None and not self._pinging.done()

    def _serving_by_lease(self, leadership: Leadership) -> None:
        """Serve while this replica's term holds; past it, step down and name the leader known."""
        if self.role == "primary":
            if leadership.holds(self):
                self._start_pings()
                return
            leadership.give_up(self, "its term ran out: no renewal for the lease's ttl less the margin")
        raise NotPrimary(f"this replica is a {self.role} at epoch {self.epoch}: {leadership.named_leader()}")

    def lead(self, listening: str, incarnation: int) -> None:
        """Start watching and campaigning for the slot's lease (with a coordinator; idempotent);
        ``listening``: the server's first address (this replica's name without ``--advertise``),
        ``incarnation``: the server's store id (its HELLO says it: a successor has another)."""
        if self.leadership is not None:
            self.leadership.start(self, listening, incarnation)

    def take_over(self, epoch: int, previous: str | None = None) -> None:
        """This backup won the slot's lease: the primary, at the coordinator's ``epoch``.
        ``previous``: the slot's primary before it, whose lease ran out or was revoked: it may be
        stopped (a connection to it opens and never answers), so it is taken back in the
        background rather than waited for by the first change. The others are waited for as
        always (at a slot's first election, every replica)."""
        if not self.epoch < epoch < replication.MAX_EPOCH:  # etcd revisions only grow
            raise ProtocolError(f"the coordinator's epoch {epoch} is not past this replica's {self.epoch}")
        self.epoch = epoch - 1  # _promote counts it up
        self._promote(previous)

    def step_down(self, why: str) -> None:
        """The term ended: acknowledge nothing more; a backup, following whoever leads next."""
        self.role = "backup"
        event(log, logging.WARNING, "stepped down: this primary no longer holds its slot's lease",
              epoch=self.epoch, why=why)  # fmt: skip

    def in_sync(self) -> list[str]:
        """The backups that hold every change acknowledged so far (the in-sync set, less this one)."""
        if self._backups is None:
            return []
        return [b.url for b in self._backups.backups.values() if b.synced and not b.lost and not b.refused]

    def reaches_all(self) -> bool:
        """Whether every backup applied a change or ping lately (the failsafe: ps/server/leadership.py)."""
        if self._backups is None:
            return True
        recent = time.monotonic() - 4 * replication.PING_SECONDS
        return all(
            b.synced and not b.lost and b.acked is not None and b.acked >= recent
            for b in self._backups.backups.values()
        )

    def _promote(self, previous: str | None = None) -> None:
        if self.epoch + 1 >= replication.MAX_EPOCH:  # cannot happen: epochs are checked on receipt
            raise NotPrimary(f"this backup is at the last epoch ({self.epoch}) and cannot take over")
        self.role = "primary"
        self.epoch += 1
        self.failovers += 1
        now = time.monotonic()
        self.holder.promoted()  # a grace period: the workers are moving over from the old primary
        if self._backups is not None and not self._pings_running():  # its peers become its backups
            self._backups.reset(previous)
            self._start_pings()
        event(log, logging.WARNING, "failover: this backup takes over", epoch=self.epoch,
              jobs=self.holder.describe(), silent_s=round(now - (self._primary_seen or now), 3))  # fmt: skip

    async def replicate(
        self, change: replication.Change, head: wps.PsHead, body: bytes = b"", data: Sequence[memoryview] = ()
    ) -> None:
        """Apply a change on every backup before making it here (inside ``in_order``). A backup
        that is new, or back, first gets every job (a state transfer)."""
        # It may have stepped down (fenced, following a newer primary, its term over: e.g. woken
        # from a long pause) while this request waited for its turn.
        self._still_primary("while the change waited for its turn")
        if self._backups is not None:
            meta = replication.encode(change, self.epoch, head, body)
            try:
                ping = change == replication.Change.PING
                await self._backups.send(meta, data, self._state_transfer, ping=ping)
            except NotPrimary:
                self._fenced()
            # The send may have waited up to the replication timeout for a backup that stopped
            # answering (cut off, stopped), then given it up: meanwhile the term may have run out
            # and that backup taken over without this change, which must then not be made here.
            self._still_primary("while the change waited for its backups")
        if self.leadership is not None:
            await self._publish_in_sync(self.leadership)

    def _still_primary(self, when: str) -> None:
        """NotPrimary unless this replica is the primary, and (with a coordinator) its term holds:
        a change must not be made or acknowledged here then, only by the primary."""
        if self.role != "primary":
            raise NotPrimary(f"this replica became a {self.role} at epoch {self.epoch}: ask another one")
        leadership = self.leadership
        if leadership is not None and not leadership.holds(self):
            leadership.give_up(self, f"its term ran out {when}")
            raise NotPrimary(f"this replica's term ran out: {leadership.named_leader()}")

    def _fenced(self) -> NoReturn:
        self.role = "fenced"
        if self.leadership is not None:
            self.leadership.give_up(self, "a backup took over from it")
        event(log, logging.ERROR, "fenced: a backup took over from this primary", epoch=self.epoch)
        raise NotPrimary("this primary was fenced: a backup took over; ask another replica") from None

    async def _publish_in_sync(self, leadership: Leadership) -> None:
        """The in-sync set as the coordinator must know it before this change is acknowledged;
        a primary that cannot write it (its term is over, the coordinator unreachable while a
        backup was lost) steps down and the change is not acknowledged."""
        try:
            await leadership.publish_in_sync(self)
        except TensorwireError as exc:
            leadership.give_up(self, f"the slot's in-sync set could not be written ({exc})")
            raise NotPrimary(f"this replica stepped down: {leadership.named_leader()}") from exc

    def _state_transfer(self) -> tuple[bytes, list[memoryview]] | None:
        """The SYNC change: every job, as it is between two changes (we are in ``in_order``)."""
        state, tensors = self.holder.take_all()
        metas = [
            TensorMeta(k, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for k, t in tensors.items()
        ]
        body = wps.encode_stats(json.dumps(state)) + wm.encode_records(metas)
        meta = replication.encode(replication.Change.SYNC, self.epoch, wps.PsHead(wps.OBSERVER), body)
        return meta, [byte_view(t.contiguous()) for t in tensors.values()]

    async def _ping_backups(self) -> None:
        while self.role == "primary":
            async with self.in_order():
                # Fenced: the loop ends. A backup refusing the credentials: logged and shown by
                # Backups; the next ping tries again (it may have been fixed).
                with contextlib.suppress(NotPrimary, ReplicationRefused):
                    await self.replicate(replication.Change.PING, wps.PsHead(wps.OBSERVER))
            await asyncio.sleep(replication.PING_SECONDS)

    # -- a backup -------------------------------------------------------------------------------
    async def on_replicate(self, request: Request, apply: Apply) -> None:
        """A backup applies its primary's change, exactly as the primary did. Only a replica of this
        slot may send one (a peer session: its HELLO offered the peer token), with an epoch in
        range; anything else is refused before any state changes."""
        if not request.from_peer:
            self._refuse_replicate(request, "not_peer")
            raise AuthenticationError(
                "PS_REPLICATE is served only to the replicas of this server's slot (a connection "
                "whose HELLO offered the peer token of ps serve --peer-token-file)"
            )
        try:
            head, change, epoch = replication.decode(request.meta)
        except ProtocolError:
            self._refuse_replicate(request, "malformed")
            raise
        if epoch < self.epoch or (epoch == self.epoch and self.role != "backup"):
            await request.skip()
            raise NotPrimary(f"epoch {epoch} is over: this replica is a {self.role} at epoch {self.epoch}")
        if self.role != "backup":
            if self.leadership is not None:
                self.leadership.give_up(self, f"a primary at epoch {epoch} took over")
            # A newer primary: it took over from this one (which was slow or cut off, or fenced
            # already). Step down and follow it; its state transfer comes first. Refusing would
            # fence it too and leave the slot with no primary.
            log.warning("a primary at epoch %d took over from this %s (epoch %d): following it",
                        epoch, self.role, self.epoch)  # fmt: skip
            self.role = "backup"
        self.epoch, self._primary_seen = epoch, time.monotonic()
        if change == replication.Change.SYNC:
            await self._receive_state(request)
        else:
            await apply(change, head, request)
        request.meta.done()
        await request.reply(b"")

    def _refuse_replicate(self, request: Request, reason: str) -> None:
        self.replicate_refused[reason] += 1
        event(log, logging.WARNING, "replication request refused", peer=request.peer, reason=reason,
              role=self.role, epoch=self.epoch)  # fmt: skip

    async def _receive_state(self, request: Request) -> None:
        state = json.loads(wps.decode_stats(request.meta))
        metas = wm.decode_records(request.meta)
        if sum(m.nbytes for m in metas) != request.header.data_len:  # what is allocated is what is sent
            raise InvalidTensor("the state transfer's records do not add up to its data length")
        tensors = {m.name: torch.empty(m.shape, dtype=m.dtype) for m in metas}
        await request.receive([byte_view(t) for t in tensors.values()])
        await self.holder.load_all(state, tensors)
        if self.leadership is not None:
            self.leadership.state_received()
        log.info("state transfer from the primary: %s", self.holder.describe())

    async def close(self) -> None:
        """Stop pinging, resign a term held, and close the connections to the backups."""
        await cancel_and_wait(self._pinging)
        self._pinging = None
        if self.leadership is not None:
            await self.leadership.close()
        if self._backups is not None:
            await self._backups.close()
