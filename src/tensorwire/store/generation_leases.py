"""Who holds leases on a server's generations, counted against the bounds peers are held to.

A lease is held by an owner (a connection; over gRPC, one calling peer) from a client host. This
table knows which generations (``(prefix, number)``) each owner holds and counts them per owner
(``leases_per_owner``) and per client host (``leases_per_client``); when and until when a
generation is held is its ``Kept``'s business (store/generations.py keeps the deadlines there).
An owner is in the table only while it holds a lease, so a connection that never leased costs
nothing here, and one that closes (``forget``) leaves nothing behind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from tensorwire.errors import LimitExceeded, NotAuthorized
from tensorwire.store.generation_config import GenerationConfig

if TYPE_CHECKING:
    from tensorwire.store.generations import Kept

LeaseKey = tuple[str, int]  # (prefix, number)


class Leases:
    """The lease table of one server's generations (see the module docstring)."""

    def __init__(
        self, config: GenerationConfig, lookup: Callable[[str, int], Kept | None], clock: Callable[[], float]
    ) -> None:
        self.config = config
        self._lookup = lookup  # the generation a key names, if it is still kept
        self._clock = clock
        self._held: dict[object, set[LeaseKey]] = {}  # owner -> its leases
        self._client: dict[object, str] = {}  # owner -> its client host
        self._per_client: Counter[str] = Counter()

    def __len__(self) -> int:
        return sum(len(held) for held in self._held.values())

    def holds(self, owner: object, key: LeaseKey) -> bool:
        return key in self._held.get(owner, ())

    def keys(self, owner: object) -> list[LeaseKey]:
        """What ``owner`` holds now."""
        return list(self._held.get(owner, ()))

    def holders(self, prefix: str) -> list[tuple[object, LeaseKey]]:
        """Every (owner, lease) on a generation of ``prefix``."""
        return [(owner, key) for owner, held in self._held.items() for key in held if key[0] == prefix]

    def grant(self, owner: object, key: LeaseKey, kept: Kept, seconds: float, client: str) -> float:
        """``owner`` (of ``client``) keeps ``kept`` (the generation ``key`` names) for ``seconds``, at
        most ``max_lease_seconds`` (a renewal moves its end); the seconds granted. LimitExceeded,
        and nothing counted, past a bound."""
        fresh = not self.holds(owner, key)
        if fresh:
            self.check_room(owner, client)
        granted = min(seconds, self.config.max_lease_seconds)
        kept.leases[owner] = self._clock() + granted
        if fresh:  # counted only once granted: a refused owner leaves nothing in the tables
            self._add(owner, key, client)
        return granted

    def end(self, owner: object, key: LeaseKey) -> None:
        """``owner``'s lease on ``key`` ends (if it has one): the one place a lease is uncounted."""
        kept = self._lookup(*key)
        if kept is not None:
            kept.leases.pop(owner, None)
        held = self._held.get(owner)
        if held is None or key not in held:
            return
        held.discard(key)
        client = self._client.get(owner, "")
        self._per_client[client] -= 1
        if self._per_client[client] <= 0:
            del self._per_client[client]
        if not held:
            del self._held[owner]
            self._client.pop(owner, None)

    def expire(self, owner: object) -> None:
        """End ``owner``'s leases that ran out (or whose generation is gone)."""
        now = self._clock()
        for key in self.keys(owner):
            kept = self._lookup(*key)
            if kept is None or kept.leases.get(owner, 0.0) <= now:
                self.end(owner, key)

    def drop_owner(self, owner: object) -> set[str]:
        """A connection ended: its leases end with it; the prefixes they were on."""
        keys = self.keys(owner)
        for key in keys:
            self.end(owner, key)
        return {prefix for prefix, _ in keys}

    def check_droppable(self, prefix: str, owner: object, kept: Mapping[int, Kept]) -> None:
        """NotAuthorized unless no owner but ``owner`` holds a live lease on one of ``kept`` (the
        generations of ``prefix`` a drop would take): a reader's lease keeps its generation against
        a drop as against a publish."""
        now = self._clock()
        leased = {number: sum(1 for who, end in gen.leases.items() if who is not owner and end > now)
                  for number, gen in kept.items()}  # fmt: skip
        held = {number: count for number, count in leased.items() if count}
        if held:
            numbers = ", ".join(map(str, sorted(held)[:8]))
            raise NotAuthorized(
                f"cannot drop {prefix!r}: other connections hold {sum(held.values())} leases on its"
                f" generations ({numbers}); a prefix is dropped only when no one else holds one (they"
                " release them, close, or the leases run out: at most --max-lease-seconds)"
            )

    def check_room(self, owner: object, client: str) -> None:
        """LimitExceeded, naming the bound and its flag, unless ``owner`` (of ``client``) may take
        one more lease (only live ones count: those that ran out end first)."""
        limits = self.config
        self.expire(owner)
        held = len(self._held.get(owner, ()))
        if held >= limits.leases_per_owner:
            have = f"this connection holds {held} leases"
            raise LimitExceeded(f"{have}: {limits.most('leases_per_owner')}")
        if self._per_client[client] >= limits.leases_per_client:
            for other in [o for o, c in self._client.items() if c == client]:
                self.expire(other)
        if self._per_client[client] >= limits.leases_per_client:
            have = f"this client ({client}) holds {self._per_client[client]} leases"
            raise LimitExceeded(f"{have}: {limits.most('leases_per_client')}")

    def _add(self, owner: object, key: LeaseKey, client: str) -> None:
        self._held.setdefault(owner, set()).add(key)
        self._client[owner] = client
        self._per_client[client] += 1
