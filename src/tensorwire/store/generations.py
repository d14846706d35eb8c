"""The generations a server keeps: per prefix, numbered tensor sets published atomically,
retained by count and by lease (docs/protocol.md §14; README, "Generations").

Lifecycle of a generation (server/generation_ops.py drives it):

1. ``admit(prefix)`` before its bytes are received: the prefix is valid, not nested in (or
   around) another prefix with generations, and within ``max_prefixes``.
2. Its tensors are received into a ``TensorStore`` reservation (capacity is checked there: a
   generation that does not fit is refused before a byte is kept, and the previous ones stay).
3. ``publish(prefix, reservation, checksums)`` keeps the reservation (``TensorStore.keep``: its
   bytes still count against the capacity), gives it the prefix's next number, and retires what
   no longer needs keeping. It is visible at once, every tensor together.
4. Reads ``pin`` one generation for their duration and ``unpin`` it after; a generation retired
   while pinned is freed by its last reader, so a read in flight always finishes consistently.
5. ``retire`` (run by ``publish``, ``sweep`` and lease changes) keeps the last ``keep`` numbers of
   each prefix and every generation with a live lease; the rest are dropped from the table (a new
   read gets ``GenerationRetired``) and freed once unpinned.

Multi-part publishes (GEN_PUBLISH_PART) are bounded where they wait (generation_parts.py).
Peer-controlled state is bounded here: prefixes (``max_prefixes``) and leases (``leases_per_owner``
per connection; a lease lasts at most ``max_lease_seconds``). Waiters are bounded where they
wait (generation_ops.py). Called from the server's event loop only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tensorwire.errors import GenerationRetired, InvalidName, KeyNotFound, LimitExceeded
from tensorwire.store.memory import Reservation, TensorStore
from tensorwire.types import ChunkSums, Generation, GenerationManifest, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire.names import validate_name

DEFAULT_KEEP = 2
DEFAULT_MAX_LEASE_SECONDS = 60.0
DEFAULT_MAX_PREFIXES = 1024
DEFAULT_LEASES_PER_OWNER = 64
DEFAULT_MAX_WAITERS = 4096
DEFAULT_WAITERS_PER_OWNER = 64
DEFAULT_MAX_WAIT_SECONDS = 300.0
DEFAULT_MAX_TRANSACTIONS = 64
DEFAULT_TRANSACTIONS_PER_OWNER = 8
DEFAULT_MAX_PARTS = 4096
# Prefixes the server publishes itself: a parameter server's relay pulls (``_ps/<job>``,
# ps/relay.py). No client publishes under it: the job's workers trust what it holds.
SERVER_PREFIX = "_ps"


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """How many generations a server keeps and how much state peers may make it hold."""

    keep: int = DEFAULT_KEEP  # the last this many generations of each prefix (--keep-generations)
    max_lease_seconds: float = DEFAULT_MAX_LEASE_SECONDS  # a longer lease is granted this long
    max_prefixes: int = DEFAULT_MAX_PREFIXES  # prefixes with generations, server-wide
    leases_per_owner: int = DEFAULT_LEASES_PER_OWNER  # leases one connection holds at once
    max_waiters: int = DEFAULT_MAX_WAITERS  # GEN_WAIT requests parked, server-wide
    waiters_per_owner: int = DEFAULT_WAITERS_PER_OWNER  # ... on one connection
    max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS  # a longer wait is answered at this point
    # multi-part publishes (GEN_PUBLISH_PART): open at once server-wide, with a part from one
    # connection, and parts in one; each waits for its others at most max_wait_seconds
    max_transactions: int = DEFAULT_MAX_TRANSACTIONS
    transactions_per_owner: int = DEFAULT_TRANSACTIONS_PER_OWNER
    max_parts: int = DEFAULT_MAX_PARTS

    def __post_init__(self) -> None:
        counts = (
            self.keep,
            self.max_prefixes,
            self.leases_per_owner,
            self.max_waiters,
            self.waiters_per_owner,
            self.max_transactions,
            self.transactions_per_owner,
            self.max_parts,
        )
        if min(counts) < 1 or self.max_lease_seconds <= 0 or self.max_wait_seconds <= 0:
            raise ValueError(f"generation limits must be positive: {self}")


@dataclass(eq=False)
class Kept:
    """One generation held in memory."""

    generation: Generation
    tensors: dict[str, tuple[TensorMeta, memoryview]]  # by full name; meta.version is the number
    sums: tuple[ChunkSums, ...]  # in name order
    reservation: Reservation
    pins: int = 0
    leases: dict[object, float] = field(default_factory=dict)  # owner -> deadline (clock)
    retired: bool = False


@dataclass(eq=False)
class Prefix:
    latest: int = 0
    kept: dict[int, Kept] = field(default_factory=dict)  # number -> generation, oldest first

    def oldest(self) -> int:
        return next(iter(self.kept), self.latest + 1)


class Generations:
    """The generations of one server's store, by prefix."""

    def __init__(
        self,
        store: TensorStore,
        config: GenerationConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.config = config or GenerationConfig()
        self.clock = clock
        self._prefixes: dict[str, Prefix] = {}
        self._leases: dict[object, set[tuple[str, int]]] = {}  # owner -> its leases

    def __len__(self) -> int:
        return len(self._prefixes)

    @property
    def generations(self) -> int:
        return sum(len(p.kept) for p in self._prefixes.values())

    def newest(self, most: int = 64) -> dict[str, int]:
        """The newest generation number of (at most ``most``) prefixes, for STATUS."""
        return {prefix: p.latest for prefix, p in list(self._prefixes.items())[:most] if p.latest in p.kept}

    # -- publishing ----------------------------------------------------------------------------
    def admit(self, prefix: str, *, internal: bool = False) -> None:
        """InvalidName / LimitExceeded unless generations of ``prefix`` may be published (under
        ``SERVER_PREFIX`` only by the server itself: ``internal``)."""
        validate_name(prefix)
        if not internal and (prefix == SERVER_PREFIX or prefix.startswith(SERVER_PREFIX + "/")):
            raise InvalidName(f"prefix {prefix!r}: {SERVER_PREFIX!r} is the server's own")
        if prefix in self._prefixes:
            return
        for other in self._prefixes:
            if prefix.startswith(other + "/") or other.startswith(prefix + "/"):
                raise InvalidName(f"prefix {prefix!r} nests with {other!r}, which has generations")
        if len(self._prefixes) >= self.config.max_prefixes:
            raise LimitExceeded(
                f"{len(self._prefixes)} prefixes have generations already: at most"
                f" {self.config.max_prefixes} (--max-prefixes)"
            )

    def publish(
        self,
        prefix: str,
        res: Reservation,
        sums: Sequence[tuple[int, ...]],
        number: int = 0,
        *,
        internal: bool = False,
    ) -> Generation:
        """Make ``res`` (received and verified; ``sums`` its chunk checksums, in its order) the
        prefix's next generation, numbered ``number`` where that is larger than the latest (a host
        leader numbers its share as its origin did: broadcast/host.py), else the latest + 1; it owns
        ``res`` from here (freed on failure too). ``internal``: the server publishes it (``admit``)."""
        try:
            self.admit(prefix, internal=internal)
            check_names(prefix, [m.name for m in res.metas])
        except BaseException:
            self.store.abort(res)
            raise
        self.store.keep(res)
        entry = self._prefixes.setdefault(prefix, Prefix())
        number = max(number, entry.latest + 1)
        pairs = sorted(zip(res.metas, res.buffers, sums, strict=True), key=lambda p: p[0].name)
        chunk_sums = tuple(ChunkSums(m.with_version(number), s) for m, _, s in pairs)
        digest = wg.root_digest(chunk_sums, wg.CHUNK_BYTES, wg.CHECKSUM_KIND)
        names = tuple(m.name for m, _, _ in pairs)
        gen = Generation(prefix, number, digest, names, sum(m.nbytes for m in res.metas))
        tensors = {m.name: (m.with_version(number), b) for m, b, _ in pairs}
        entry.kept[number] = Kept(gen, tensors, chunk_sums, res)
        entry.latest = number
        self.retire(prefix)
        return gen

    # -- reading -------------------------------------------------------------------------------
    def latest(self, prefix: str) -> Generation | None:
        entry = self._prefixes.get(prefix)
        if entry is None or entry.latest not in entry.kept:
            return None
        return entry.kept[entry.latest].generation

    def pin(self, prefix: str, at: int) -> Kept:
        """Generation ``at`` of ``prefix`` (``wg.LATEST``: the newest), pinned until ``unpin``."""
        kept = self.find(prefix, at)
        kept.pins += 1
        return kept

    def unpin(self, kept: Kept) -> None:
        kept.pins -= 1
        if kept.pins == 0 and kept.retired:
            self.store.free_kept(kept.reservation)

    def find(self, prefix: str, at: int) -> Kept:
        """The kept generation; KeyNotFound or GenerationRetired naming what there is."""
        self.retire(prefix)  # leases that ran out since the last look
        entry = self._prefixes.get(prefix)
        if entry is None or not entry.latest:
            raise KeyNotFound(f"prefix {prefix!r} has no generations")
        number = entry.latest if at == wg.LATEST else at
        kept = entry.kept.get(number)
        if kept is not None:
            return kept
        if number > entry.latest:
            raise KeyNotFound(f"prefix {prefix!r} has no generation {number} yet (latest: {entry.latest})")
        raise GenerationRetired(
            f"generation {number} of {prefix!r} is retired; the oldest kept is {entry.oldest()}"
            f" (latest: {entry.latest})"
        )

    def prefix_of(self, names: Sequence[str]) -> str:
        """The one prefix with generations that every full name in ``names`` lies under."""
        found = {self._prefix_of(name) for name in names}
        if len(found) != 1:
            raise InvalidName("the names of one read at a generation must lie under one prefix")
        return found.pop()

    def _prefix_of(self, name: str) -> str:
        cut = name.rfind("/")
        while cut > 0:
            if name[:cut] in self._prefixes:
                return name[:cut]
            cut = name.rfind("/", 0, cut)
        raise KeyNotFound(f"{name!r} lies under no prefix with generations (names are 'prefix/key')")

    def manifest(self, kept: Kept) -> GenerationManifest:
        return GenerationManifest(kept.generation, wg.CHUNK_BYTES, int(wg.CHECKSUM_KIND), kept.sums)

    # -- leases --------------------------------------------------------------------------------
    def lease(self, owner: object, prefix: str, number: int, seconds: float) -> tuple[float, int]:
        """Keep generation ``number`` for ``owner`` for ``seconds`` (at most ``max_lease_seconds``;
        0 releases); returns the seconds granted and the oldest generation kept."""
        key = (prefix, number)
        held = self._leases.setdefault(owner, set())
        if seconds <= 0:
            entry = self._prefixes.get(prefix)
            kept = entry.kept.get(number) if entry is not None else None
            if kept is not None:
                kept.leases.pop(owner, None)
            held.discard(key)
            self.retire(prefix)
            return 0.0, self._oldest(prefix)
        kept = self.find(prefix, number)
        self._forget_expired(owner, held)
        if key not in held and len(held) >= self.config.leases_per_owner:
            raise LimitExceeded(
                f"this connection holds {len(held)} leases: at most {self.config.leases_per_owner}"
            )
        granted = min(seconds, self.config.max_lease_seconds)
        kept.leases[owner] = self.clock() + granted
        held.add(key)
        return granted, self._oldest(prefix)

    def _forget_expired(self, owner: object, held: set[tuple[str, int]]) -> None:
        """Drop ``owner``'s leases that ran out (or whose generation is gone) from its count."""
        now = self.clock()
        for prefix, number in list(held):
            entry = self._prefixes.get(prefix)
            kept = entry.kept.get(number) if entry is not None else None
            if kept is None or kept.leases.get(owner, 0.0) <= now:
                held.discard((prefix, number))
                if kept is not None:
                    kept.leases.pop(owner, None)

    def drop_owner(self, owner: object) -> None:
        """A connection ended: its leases end with it."""
        for prefix, number in self._leases.pop(owner, set()):
            entry = self._prefixes.get(prefix)
            kept = entry.kept.get(number) if entry is not None else None
            if kept is not None:
                kept.leases.pop(owner, None)
                self.retire(prefix)

    def _oldest(self, prefix: str) -> int:
        entry = self._prefixes.get(prefix)
        return entry.oldest() if entry is not None else 0

    # -- retention -----------------------------------------------------------------------------
    def retire(self, prefix: str) -> None:
        """Drop the generations of ``prefix`` past the last ``keep`` that no live lease holds."""
        entry = self._prefixes.get(prefix)
        if entry is None:
            return
        now = self.clock()
        floor = entry.latest - self.config.keep
        for number, kept in list(entry.kept.items()):
            if number > floor:
                break
            for owner, deadline in list(kept.leases.items()):
                if deadline <= now:
                    del kept.leases[owner]
                    self._leases.get(owner, set()).discard((prefix, number))
            if not kept.leases:
                del entry.kept[number]
                kept.retired = True
                if kept.pins == 0:
                    self.store.free_kept(kept.reservation)

    def forget(self, prefix: str) -> None:
        """Drop every generation of ``prefix`` and the prefix (its owner ended, a parameter-server
        job say); those being read are freed by their last reader. Leases on them end."""
        entry = self._prefixes.pop(prefix, None)
        if entry is not None:
            self._free(entry)
            for held in self._leases.values():
                held.difference_update({key for key in held if key[0] == prefix})

    def close(self) -> None:
        """The server stops: free every generation not being read."""
        for entry in self._prefixes.values():
            self._free(entry)

    def _free(self, entry: Prefix) -> None:
        for kept in entry.kept.values():
            kept.retired = True
            if kept.pins == 0:
                self.store.free_kept(kept.reservation)
        entry.kept.clear()


def check_names(prefix: str, names: Sequence[str]) -> None:
    """InvalidName unless every name is ``prefix/key`` (the names themselves are checked by the
    store's reservation)."""
    head = prefix + "/"
    for name in names:
        if not name.startswith(head):
            raise InvalidName(f"{name!r} is not under the prefix {prefix!r} it is published to")
