"""A replica slot's primary, decided by a coordinator's lease (``ps serve --coordinator``):
``Leadership``.

Without a coordinator a slot's replicas decide among themselves (ps/server/replica.py: a standby
takes over when its primary has been silent for ``failover_timeout`` and a worker asks). With one,
they do what Patroni and Kubernetes controllers do: every replica starts as a backup; the one
holding the slot's lease is the primary, under the coordinator's number for that term as its epoch
(etcd: the revision that created the leader key), so the fencing token comes from the
coordinator, not from a process.

* **Keeping the term.** The primary renews every ``ttl / 3``. Its term holds until ``ttl -
  margin`` after the last renewal *was sent* (``Term.valid_until``): the coordinator cannot let the
  lease pass before then. Past it, the primary stops acknowledging (``holds`` is false: the replica
  answers NOT_PRIMARY naming the leader it knows) unless the failsafe below applies. A renewal
  answered "lease lost" ends the term at once.
* **Failsafe.** With the coordinator unreachable, a primary that still reaches every replica of
  its slot (each applied the last ping or change) keeps serving, as Patroni's failsafe mode does:
  no replica can have taken over without the lease, and one that did would refuse this primary's
  next change (a newer epoch fences it). A primary that lost a replica steps down instead.
* **Who may take over.** The primary keeps the slot's *in-sync set* in the coordinator: itself and
  the backups that hold every change it acknowledged. It writes the set (bound to its term: a
  write after the term ended fails) before it acknowledges anything without a backup that was in
  it. A backup campaigns only once the lease is gone, only if it is in the set and has received
  the state since this process started (a restarted, empty replica is not up to date, whatever
  its address), and the campaign fails if the set changed meanwhile. A slot whose in-sync replicas
  are all gone stays down and says why (``down``: status, metrics, log), rather than lose
  acknowledged updates; an operator who accepts the loss deletes the in-sync key.
* **A dead primary.** A backup in the set whose primary has been silent for ``SILENT`` probes
  the primary's address, if it is one of its ``--backup`` peers (the probe offers the peer token):
  refused, or answered by another process, means gone, and its lease is revoked rather than waited
  out. A probe the stopped process never answers gives way to the lease's end.
* **Taking over.** The new primary waits for every peer with its first change as always, except
  the primary before it (``previous``), which may be stopped: the pings take that one back.
* A replica started with ``--standby`` lets the others campaign first: it waits one ``ttl`` at start,
  or until it sees one of them lead.

Lifecycle: made with the server's options, ``start(replica)`` on the server's loop when the
replica starts serving (a task watches the leader and campaigns or renews), ``close`` resigns a
held term (the lease goes at once: a successor need not wait for it to run out) and closes the
coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from tensorwire import transport as transports
from tensorwire._aio import cancel_and_wait, within
from tensorwire.coordinator import Coordinator, Leader, Term, open_coordinator
from tensorwire.coordinator.codec import check_slot
from tensorwire.errors import CoordinatorUnavailable, LeaseLost, TensorwireError
from tensorwire.logs import event
from tensorwire.security import Security, TlsFiles
from tensorwire.types import Address

log = logging.getLogger("tensorwire.ps")
DEFAULT_TTL = 3.0
# A primary silent this long (it pings twice a second), whose address refuses connections, is gone.
SILENT = 1.0
PROBE_TIMEOUT = 0.5
COORDINATOR_TIMEOUT = 2.0  # each call to the coordinator (a renewal: at most a third of the ttl)
_WILDCARDS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class Coordination:
    """How a replica takes part in its slot's leadership (``ps serve --coordinator URL --slot
    NAME``): the coordinator's URL and credentials, the slot, the address the slot's peers and
    workers reach this replica at (``--advertise``; default: where it listens), the lease's ttl."""

    url: str
    slot: str
    advertise: str | None = None
    ttl: float = DEFAULT_TTL
    tls: TlsFiles | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout: float = COORDINATOR_TIMEOUT

    def __post_init__(self) -> None:
        check_slot(self.slot)
        if self.ttl < 1:
            raise ValueError(f"lease ttl {self.ttl!r}: at least 1 second")

    def leadership(self, *, standby: bool) -> Leadership:
        coordinator = open_coordinator(
            self.url, tls=self.tls, user=self.user, password=self.password, timeout=self.timeout
        )
        return Leadership(coordinator, self.slot, self.advertise, ttl=self.ttl, standby=standby)


class Led(Protocol):
    """The replica, as its leadership drives it (ps/server/replica.py ``Replica``)."""

    role: str

    def take_over(self, epoch: int, previous: str | None) -> None:
        """This backup won the lease: become the primary at ``epoch``; ``previous`` is the
        address of the slot's last primary before it (None: none was seen), which may be stopped
        and is not waited for."""
        ...

    def step_down(self, why: str) -> None:
        """The term ended: stop acknowledging; a backup from now on."""
        ...

    def in_sync(self) -> list[str]:
        """The backups that hold every change acknowledged so far (their URLs)."""
        ...

    def reaches_all(self) -> bool:
        """Whether every backup of the slot applied the last ping or change (the failsafe)."""
        ...

    @property
    def primary_seen(self) -> float | None:
        """When (monotonic) this backup last heard from its primary."""
        ...

    @property
    def peer(self) -> Security:
        """How this replica reaches the others of its slot (the peer token and TLS files)."""
        ...

    def is_peer(self, address: str) -> bool:
        """Whether ``address`` is one of the slot's replicas this one was given (``--backup``)."""
        ...


class Leadership:
    """This replica's part in its slot's leadership by lease (see the module doc)."""

    def __init__(
        self,
        coordinator: Coordinator,
        slot: str,
        address: str | None,
        *,
        ttl: float = DEFAULT_TTL,
        standby: bool = False,
    ) -> None:
        if ttl < 1:
            raise ValueError(f"lease ttl {ttl!r}: at least 1 second")
        self.coordinator = coordinator
        self.slot = slot
        # This replica's member name, as the others list it with --backup (None: ``start`` says).
        self.address = address or ""
        self.ttl = ttl
        self.margin = max(0.2, ttl / 6)  # what a renewal's answer may take beyond the send time
        self.term: Term | None = None
        self.leader: Leader | None = None  # the slot's leader as last seen
        self.previous: str | None = None  # the last other replica seen leading (its address)
        self.synced = False  # received the state from a primary since this process started
        self.down: str | None = None  # why this replica may not take over, when it may not
        self.failsafe = False  # serving past the term: the coordinator is unreachable
        self.step_downs = 0
        self.revoked = 0  # leases of dead primaries this backup revoked (not waited out)
        self.unavailable = 0  # coordinator calls that failed since the last renewal
        self.errors = 0  # coordinator calls that failed, in all
        self._standby = standby
        self._published: list[str] | None = None  # the in-sync set as last written
        self._growing: asyncio.Task[None] | None = None  # writing a larger set, in the background
        self.incarnation = 0  # this process (its server's store id): set at start
        self._writing = asyncio.Lock()  # in-sync writes, one at a time
        self._changed = asyncio.Event()
        self._looked: tuple[int, str] | None = None  # the last probe's answer logged, per epoch
        self._tasks: list[asyncio.Task[None]] = []

    # -- what the replica asks --------------------------------------------------------------------
    def holds(self, replica: Led) -> bool:
        """Whether this replica may act as the primary now: its term holds, or (coordinator
        unreachable) the failsafe keeps it."""
        term = self.term
        if term is None:
            return False
        if not term.expired(self.margin):
            return True
        self.failsafe = self.unavailable > 0 and replica.reaches_all()
        return self.failsafe

    def _unreachable(self) -> None:
        self.unavailable += 1
        self.errors += 1

    def named_leader(self) -> str:
        """The leader to name in a NOT_PRIMARY answer."""
        leader = self.leader
        if leader is None or leader.address == self.address:
            return "no primary is known now" + (f" ({self.down})" if self.down else "")
        return f"the primary is {leader.address} (epoch {leader.epoch})"

    async def publish_in_sync(self, replica: Led) -> None:
        """Write the in-sync set if it changed: a set that lost a member (or a new term's first)
        before this returns, and so before the change is acknowledged (LeaseLost or
        CoordinatorUnavailable: it must not be); a set that only grew in the background (the one
        written still names no one out of date, and an etcd write can take a while: the changes
        and the renewals must not wait for it)."""
        term = self.term
        if term is None:  # the term ended (the caller checked it holds, then waited): nothing to
            raise LeaseLost(f"slot {self.slot}: this replica holds no term")  # acknowledge by it
        members = [self.address, *sorted(replica.in_sync())]
        published = self._published
        if members == published:
            return
        if published is not None and set(published) <= set(members):
            if self._growing is None or self._growing.done():
                self._growing = asyncio.get_running_loop().create_task(self._write_in_sync(term, members))
            return
        await self._write_in_sync(term, members, wait=True)

    async def _write_in_sync(self, term: Term, members: list[str], *, wait: bool = False) -> None:
        """One write at a time (a background write of a larger set never lands after a smaller one)."""
        async with self._writing:
            # A renewal may have replaced the term meanwhile: the same epoch is the same term.
            held = self.term
            if held is None or held.epoch != term.epoch:
                if wait:
                    raise LeaseLost(f"slot {self.slot}: the term ended before the in-sync set was written")
                return
            try:
                await self.coordinator.set_in_sync(held, members)
            except (CoordinatorUnavailable, LeaseLost) as exc:
                if isinstance(exc, CoordinatorUnavailable):
                    self._unreachable()
                if wait:
                    raise
                return  # a larger set: the one written still holds; the next change tries again
            self._published = members
        log.info("slot %s: in sync %s", self.slot, members)

    def state_received(self) -> None:
        """A state transfer from a primary arrived: this backup is up to date from now on."""
        self.synced = True

    def status(self) -> dict[str, object]:
        """This replica's view of its slot's leadership (PS_STATS, STATUS, metrics)."""
        leader = self.leader
        return {
            "slot": self.slot,
            "member": self.address,
            "leader": leader.address if leader is not None else None,
            "leader_epoch": leader.epoch if leader is not None else None,
            "holds_term": self.term is not None,
            "in_sync": list(self._published or []),
            "down": self.down,
            "failsafe": self.failsafe,
            "step_downs": self.step_downs,
            "revoked": self.revoked,
            "coordinator_errors": self.errors,
        }

    # -- the task ---------------------------------------------------------------------------------
    def start(self, replica: Led, listening: str, incarnation: int = 0) -> None:
        """Watch the slot's leader and campaign or renew, on the running loop (idempotent).
        ``listening``: the server's first address, this replica's name without ``--advertise``;
        ``incarnation``: this process (the server's store id, which its HELLO says)."""
        if self._tasks:
            return
        self.incarnation = incarnation
        if not self.address:
            if Address.parse(listening).host in _WILDCARDS:
                raise ValueError(
                    f"this server listens on {listening}: give --advertise the URL its slot's peers "
                    "and workers reach it at (the one they list it with)"
                )
            self.address = listening
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._watch()), loop.create_task(self._lead(replica))]

    async def _watch(self) -> None:
        while True:
            try:
                async for leader in self.coordinator.watch(self.slot):
                    self.leader = leader
                    if leader is not None and leader.address != self.address:
                        self.previous = leader.address
                    self._changed.set()
            except TensorwireError as exc:  # the first read failed: the campaign loop says so
                self._unreachable()
                log.debug("slot %s: watching the leader failed (%s)", self.slot, exc)
            await asyncio.sleep(self.ttl / 3)

    async def _lead(self, replica: Led) -> None:
        if self._standby:  # let the others campaign first: for a ttl, or until one of them leads
            with contextlib.suppress(TimeoutError):
                await within(self._until_led(), self.ttl)
        while True:
            try:
                if self.term is None:
                    await self._campaign(replica)
                else:
                    await self._renew(replica)
            except Exception as exc:
                self.errors += 1
                event(log, logging.ERROR, "leadership: unexpected failure; going on", slot=self.slot,
                      error=f"{type(exc).__name__}: {exc}"[:300])  # fmt: skip
                await asyncio.sleep(self.ttl / 6)

    async def _campaign(self, replica: Led) -> None:
        """Wait for the lease to be free, then try to take it (if this replica may)."""
        self._changed.clear()
        try:
            in_sync = await self._may_campaign(replica)
            if in_sync is not None:
                term = await self.coordinator.campaign(
                    self.slot, self.address, self.address, self.ttl, in_sync_revision=in_sync,
                    incarnation=self.incarnation,
                )  # fmt: skip
                if term is not None:
                    self._won(term, replica)
                    return
        except CoordinatorUnavailable as exc:
            self._unreachable()
            log.info("slot %s: campaign not possible now (%s)", self.slot, exc)
        with contextlib.suppress(TimeoutError):  # a watch event, or a look again after a while
            await within(self._changed.wait(), self._look_again(replica))

    async def _until_led(self) -> None:
        """Return once the watch has seen a leader. A standby that slept out its whole ttl while
        the others had already elected one looked at the lease only after it: a primary killed
        meanwhile had its lease run out rather than revoked (seen under ``make test``'s load)."""
        while self.leader is None:
            self._changed.clear()  # no await since the check: the watch cannot have set it between
            await self._changed.wait()

    def _look_again(self, replica: Led) -> float:
        """Seconds to the next look at the lease without a watch event: every ``ttl / 3``, and
        four times a ``SILENT`` period while the primary is quiet (a dead one's lease is revoked
        about ``SILENT`` after its last ping, not up to ``ttl / 3`` later)."""
        seen = replica.primary_seen
        if seen is not None and time.monotonic() - seen >= SILENT / 2:
            return min(self.ttl / 3, SILENT / 4)
        return self.ttl / 3

    async def _may_campaign(self, replica: Led) -> int | None:
        """If the lease is free and this replica is up to date, the revision of the in-sync set
        that says so (0: none written yet, a new slot), which the campaign requires unchanged (a
        replica paused between this read and its campaign must not win on what it read). Else
        None, and ``down`` says why."""
        leader = await self.coordinator.leader(self.slot)
        if leader is not None and not await self._gone(leader, replica):
            self.down = None
            return None
        in_sync = await self.coordinator.in_sync(self.slot)
        if in_sync is None:  # a new slot: every replica is as up to date as the others
            return 0
        if self.address in in_sync.members and self.synced:
            return in_sync.revision
        listed = list(in_sync.members[:8])
        state = "is not in it" if self.address not in in_sync.members else "restarted since"
        why = f"slot {self.slot} has no primary; the in-sync set is {listed} and this replica {state}"
        if why != self.down:
            event(log, logging.ERROR, "slot down: this replica is not up to date, so it may not take over",
                  slot=self.slot, in_sync=listed, this=self.address, synced=self.synced)  # fmt: skip
        self.down = why
        return None

    async def _gone(self, leader: Leader, replica: Led) -> bool:
        """Whether ``leader`` is another replica whose process is gone (its lease, then, is
        revoked, so that the slot need not wait for it to run out). Gone means: this backup, up
        to date, has not heard from it for ``SILENT`` seconds, and its address refuses a
        connection (nothing listens there) or is served by another process (its HELLO says
        another store id than the leader's incarnation: it was restarted). A process that is
        alive but cut off gives no answer at all, and then the lease runs its course. Safe even
        if it were alive: it acknowledges nothing that this backup has not applied, unless it
        writes to the coordinator under its lease first, which the revocation ends. Only a
        replica this one was given is probed: the probe offers the slot's peer credentials, which
        a leader key naming another address (anyone who may write the prefix) must not collect."""
        if leader.address == self.address or not self.synced or not leader.lease:
            return False
        if not replica.is_peer(leader.address):
            return False
        seen = replica.primary_seen
        if seen is not None and time.monotonic() - seen < SILENT:
            return False
        if not await self._probe(leader, replica):
            return False
        event(log, logging.WARNING, "the primary's process is gone: revoking its lease", slot=self.slot,
              primary=leader.address, epoch=leader.epoch)  # fmt: skip
        await self.coordinator.revoke(leader)
        self.revoked += 1
        return True

    async def _probe(self, leader: Leader, replica: Led) -> bool:
        """Whether ``look_at`` finds the leader's process ``GONE``, given up when the leader key
        changes meanwhile: a stopped primary answers no probe for its whole timeout, and its lease
        running out in that time must start the campaign now, not when the probe gives up. A
        primary found not gone is logged once per epoch and answer (why its lease is waited out)."""
        probe = asyncio.ensure_future(look_at(leader, replica.peer))
        changed = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({probe, changed}, return_when=asyncio.FIRST_COMPLETED)
            answer = probe.result() if probe.done() else "given up: the leader key changed"
        finally:
            await cancel_and_wait(probe)
            await cancel_and_wait(changed)
        kind = answer.split(" (")[0]  # the same answer, whatever its detail
        if answer not in GONE and (leader.epoch, kind) != self._looked:
            self._looked = (leader.epoch, kind)
            event(log, logging.WARNING, "the quiet primary is not known to be gone: its lease runs out",
                  slot=self.slot, primary=leader.address, epoch=leader.epoch, answer=answer)  # fmt: skip
        return answer in GONE

    def _won(self, term: Term, replica: Led) -> None:
        self.term, self.down, self.failsafe, self._published = term, None, False, None
        self.leader = term.leader
        self.synced = True  # a primary holds its own state
        replica.take_over(term.epoch, self.previous)

    async def _renew(self, replica: Led) -> None:
        term = self.term
        assert term is not None
        await asyncio.sleep(max(0.0, term.renewed_at + term.ttl / 3 - time.monotonic()))
        # The term may be given up while this task waits (give_up: a change could not be made or
        # acknowledged); it stays given up: a renewal answered later must not bring it back (a
        # backup renewing the lease would keep every other replica from taking over), nor count
        # a second step-down.
        if self.term is not term:
            return
        try:
            renewed = await self.coordinator.renew(term)
            if self.term is not term:
                return
            self.term = term = renewed
            self.unavailable, self.failsafe = 0, False
        except LeaseLost as exc:
            if self.term is term:
                self.give_up(replica, str(exc))
        except CoordinatorUnavailable as exc:
            if self.term is not term:
                return
            self._unreachable()
            if term.expired(self.margin) and not self.holds(replica):
                self.give_up(replica, f"the term ran out with the coordinator unreachable ({exc})")
            else:
                await asyncio.sleep(min(0.25, term.ttl / 12))

    def give_up(self, replica: Led, why: str) -> None:
        """The term is over (lost, run out, or the in-sync set could not be written): a backup now."""
        self.term, self.failsafe = None, False
        self.step_downs += 1
        if replica.role == "primary":
            replica.step_down(why)

    async def close(self) -> None:
        """Stop watching and campaigning; resign a term held (a successor need not wait out its
        lease); close the coordinator."""
        for task in [*self._tasks, self._growing]:
            await cancel_and_wait(task)
        self._tasks, self._growing = [], None
        if self.term is not None:
            await self.coordinator.resign(self.term)
            self.term = None
        await self.coordinator.close()


# What ``look_at`` answers when the process holding a lease is gone: nothing listens at its address,
# or another process answers there (its HELLO's store id is not the leader's incarnation: it was
# started again). No answer, or a leader that did not say its incarnation: not known, so not gone.
GONE = ("refused", "another process")


async def look_at(leader: Leader, peer: Security) -> str:
    """What ``leader``'s address says of its process: ``refused``, ``another process``, ``the
    same process``, ``unnamed`` (the leader did not say its incarnation) or ``no answer (...)``;
    the first two are ``GONE``."""
    options = transports.TransportOptions(PROBE_TIMEOUT, PROBE_TIMEOUT, security=peer)
    try:
        conn = await transports.open_channel(leader.address, options, what="a look at the primary")
    except TensorwireError as exc:
        return "refused" if _refused(exc) else f"no answer ({exc})"[:200]
    try:
        if leader.incarnation == 0:
            return "unnamed"
        return "the same process" if conn.info.store_id in (0, leader.incarnation) else "another process"
    finally:
        await conn.close()


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection was refused (the cause of a ConnectError)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
