"""The seam between a parameter-server replica slot and the coordinator that decides its primary.

A slot's replicas campaign for one leader key; the coordinator binds the key to a lease that the
winner keeps alive. The key goes when the lease does (the winner resigned, stopped renewing, or
died), and the next campaign creates it again, with a larger epoch.

Lifecycle, for a replica (the *member*):

1. ``campaign(slot, member, address, ttl)``: ``Term`` if this member now leads the slot, ``None``
   if another does (or the key holds something that is not a leader: it is never taken over).
2. While it leads: ``renew(term)`` well within ``term.ttl`` (a third of it, say), each call
   returning the term with its new ``renewed_at``. The member may act as primary only until
   ``term.valid_until(margin)``: that bound is taken from the moment *before* the renewal was
   sent, so it never outlives the lease the coordinator holds. ``LeaseLost`` means the term is
   over: step down at once. ``CoordinatorUnavailable`` means nothing is known: keep trying, and
   step down when ``valid_until`` passes.
3. ``resign(term)`` ends a term at once (the key goes, a watcher sees ``None``): best-effort and
   bounded, it never raises.

The slot's *in-sync set* (the members that hold every change its primary acknowledged) is the
primary's to write, and only while its term holds (``set_in_sync``: refused with ``LeaseLost``
once the leader key is not its term's); anyone may read it (``in_sync``). A member that relies on
it to campaign passes the revision it read (``campaign(..., in_sync_revision=)``), so that a set
rewritten meanwhile makes the campaign fail rather than win on what it read.

For a watcher (a worker, a backup): ``leader(slot)`` reads the slot's leader once; ``watch(slot)``
yields it, then every change, until ``close()``.

Every call waits a bounded time (the coordinator's ``timeout``) and raises
``CoordinatorUnavailable`` when the coordinator does not answer in it. ``close()`` ends watches and
releases the connection; a closed coordinator is not reused.
"""

from __future__ import annotations

import abc
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

DEFAULT_TIMEOUT = 2.0  # seconds any one call to the coordinator may take


@dataclass(frozen=True, slots=True)
class Leader:
    """Who leads a slot, as a watcher sees it: the member's name, the URL workers should use, and
    the epoch of its term (strictly increasing across the slot's terms)."""

    member: str
    address: str
    epoch: int
    lease: int = field(default=0, compare=False)  # the lease holding the key (0: not known)
    # The leader's process (its server's random store id, which its HELLO says; 0: not said): a
    # process at ``address`` that says another is not the one holding the lease.
    incarnation: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class InSync:
    """A slot's in-sync set as read: its members (their names), and the revision that last wrote
    it (a campaign relying on it requires that revision unchanged)."""

    members: tuple[str, ...]
    revision: int


@dataclass(frozen=True, slots=True)
class Term:
    """One member's term as a slot's primary.

    ``epoch`` is the coordinator's number for the term (etcd: the leader key's create revision),
    strictly increasing across the slot's terms: a fencing token. ``renewed_at`` is the
    ``time.monotonic()`` taken before the last successful renewal (or the campaign) was sent.
    """

    slot: str
    member: str
    address: str
    epoch: int
    lease_id: int
    ttl: float
    renewed_at: float
    incarnation: int = 0

    def valid_until(self, margin: float = 0.0) -> float:
        """The ``time.monotonic()`` until which this term surely holds, less ``margin`` seconds."""
        return self.renewed_at + self.ttl - margin

    def expired(self, margin: float = 0.0, now: float | None = None) -> bool:
        """Whether the term can no longer be relied on (``now``: a ``time.monotonic()``)."""
        return (time.monotonic() if now is None else now) >= self.valid_until(margin)

    @property
    def leader(self) -> Leader:
        return Leader(self.member, self.address, self.epoch, self.lease_id, self.incarnation)


class Coordinator(abc.ABC):
    """Leadership of replica slots through leases (see the module docstring for the lifecycle)."""

    @abc.abstractmethod
    async def campaign(
        self,
        slot: str,
        member: str,
        address: str,
        ttl: float,
        *,
        in_sync_revision: int | None = None,
        incarnation: int = 0,
    ) -> Term | None:
        """Try to become ``slot``'s leader under a lease of ``ttl`` seconds: the term, or ``None``
        when the slot has a leader key already (the lease granted for the try is revoked).
        ``in_sync_revision``: also ``None`` unless the in-sync set is still the one read at that
        revision (0: none written). ``incarnation``: this member's process, which the others tell
        from a successor at the same address by it."""

    @abc.abstractmethod
    async def in_sync(self, slot: str) -> InSync | None:
        """``slot``'s in-sync set, or ``None`` if none was ever written (a new slot). A value that
        is not a set we wrote reads as an empty set (nobody may rely on it), with a warning."""

    @abc.abstractmethod
    async def set_in_sync(self, term: Term, members: Sequence[str]) -> None:
        """Write ``term.slot``'s in-sync set, if ``term`` is still the slot's leader; else
        ``LeaseLost``."""

    @abc.abstractmethod
    async def renew(self, term: Term) -> Term:
        """Keep ``term``'s lease alive once: ``term`` with a new ``renewed_at``. ``LeaseLost`` when
        the lease is gone or the leader key is no longer this term's."""

    @abc.abstractmethod
    async def resign(self, term: Term) -> None:
        """End ``term`` now (its leader key goes with its lease). Bounded, best-effort: an
        unreachable coordinator is logged, never raised; the lease then runs out on its own."""

    @abc.abstractmethod
    async def revoke(self, leader: Leader) -> None:
        """End ``leader``'s term now (its key goes with its lease): for a member that knows the
        leader's process is gone. Bounded, best-effort, like ``resign``."""

    @abc.abstractmethod
    async def leader(self, slot: str) -> Leader | None:
        """``slot``'s leader now; ``None`` when it has none (or its key holds no valid leader)."""

    @abc.abstractmethod
    def watch(self, slot: str) -> AsyncIterator[Leader | None]:
        """``slot``'s leader now, then each change, until ``close()``. The first read raises like
        ``leader``; a stream that breaks later is reopened (with backoff), and the leader read
        again and yielded after each reopening, so that no change goes unseen."""

    @abc.abstractmethod
    async def close(self) -> None:
        """End every watch and release the connection. Idempotent."""

    async def __aenter__(self) -> Coordinator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
