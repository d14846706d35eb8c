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
  A primary pings its backups twice a second while it serves.
* ``replicate``: a backup refusing a change with a newer epoch fences this primary (role
  ``fenced``: it answers NOT_PRIMARY from then on). A backup that is new, or back, first gets
  every job (the SYNC state transfer, from the ``Holder``: ps/server/jobs.py).
* ``on_replicate``: a backup checks that a change comes from a replica of its slot (a peer
  session) under an epoch in range, follows a newer primary, takes a state transfer itself and
  hands every other change to the server to make, exactly as the primary made it.

Lifecycle: made with the server (``standby``: a backup at epoch 0; else the primary at epoch 1),
then given what holds the jobs (``hold``); the first request served starts the pings; ``close``
stops them and closes the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import torch

from tensorwire._aio import cancel_and_wait
from tensorwire.errors import (
    AuthenticationError,
    InvalidTensor,
    NotPrimary,
    ProtocolError,
    ReplicationRefused,
)
from tensorwire.logs import event
from tensorwire.ps.server import replication
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
    ) -> None:
        self.role = "backup" if standby else "primary"
        self.epoch = 0 if standby else 1
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
        been silent for ``failover_timeout`` takes over first."""
        if self.role == "primary":
            if self._backups is not None and self._pinging is None:
                self._pinging = asyncio.get_running_loop().create_task(self._ping_backups())
            return
        seen = self._primary_seen
        if self.role == "backup" and seen is not None and time.monotonic() - seen > self.failover_timeout:
            self._promote()
            return
        raise NotPrimary(f"this replica is a {self.role} at epoch {self.epoch}: ask another one")

    def _promote(self) -> None:
        if self.epoch + 1 >= replication.MAX_EPOCH:  # cannot happen: epochs are checked on receipt
            raise NotPrimary(f"this backup is at the last epoch ({self.epoch}) and cannot take over")
        self.role = "primary"
        self.epoch += 1
        self.failovers += 1
        now = time.monotonic()
        self.holder.promoted()  # a grace period: the workers are moving over from the old primary
        if self._backups is not None and self._pinging is None:  # its peers become its backups
            self._backups.reset()
            self._pinging = asyncio.get_running_loop().create_task(self._ping_backups())
        event(log, logging.WARNING, "failover: this backup takes over", epoch=self.epoch,
              jobs=self.holder.describe(), silent_s=round(now - (self._primary_seen or now), 3))  # fmt: skip

    async def replicate(
        self, change: replication.Change, head: wps.PsHead, body: bytes = b"", data: Sequence[memoryview] = ()
    ) -> None:
        """Apply a change on every backup before making it here (inside ``in_order``). A backup
        that is new, or back, first gets every job (a state transfer)."""
        if self.role != "primary":
            # It stepped down (fenced, or following a newer primary) while this request waited
            # for its turn: the change must not be made or acknowledged here, only by the primary.
            raise NotPrimary(f"this replica became a {self.role} at epoch {self.epoch}: ask another one")
        if self._backups is None:
            return
        meta = replication.encode(change, self.epoch, head, body)
        try:
            await self._backups.send(meta, data, self._state_transfer, ping=change == replication.Change.PING)
        except NotPrimary:
            self.role = "fenced"
            event(log, logging.ERROR, "fenced: a backup took over from this primary", epoch=self.epoch)
            raise NotPrimary("this primary was fenced: a backup took over; ask another replica") from None

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
        log.info("state transfer from the primary: %s", self.holder.describe())

    async def close(self) -> None:
        """Stop pinging and close the connections to the backups."""
        await cancel_and_wait(self._pinging)
        self._pinging = None
        if self._backups is not None:
            await self._backups.close()
