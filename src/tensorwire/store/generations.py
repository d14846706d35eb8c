"""The generations a server keeps: per prefix, numbered tensor sets published atomically,
retained by count and by lease, and kept in the data directory when there is one (docs/protocol.md
§14; README, "Generations").

Lifecycle of a generation (server/generation_ops.py drives it):

1. ``admit(prefix)`` before its bytes are received: the prefix is valid, not nested in (or
   around) another prefix with generations, and within ``max_prefixes`` (and, for a new prefix,
   ``prefixes_per_client`` of the client that makes it).
2. Its tensors are received into a ``TensorStore`` reservation (capacity is checked there: a
   generation that does not fit is refused before a byte is kept, and the previous ones stay).
3. ``publish_durable`` (``publish`` where nothing is written): ``prepare`` keeps the reservation
   (``TensorStore.keep``: its bytes still count against the capacity) and numbers it (the prefix's
   next number); with a data directory it is written there (store/generation_disk.py, on the
   store's disk thread: one publish at a time, so numbers and files agree) before ``install``
   makes it visible, every tensor together, and retires what no longer needs keeping. So once a
   publish has returned, its generation survives a kill -9 (generation_durable.py). A server's own
   generations (``SERVER_PREFIX``, a parameter server's relay copies) are memory-only: they are
   made again from the job's state.
4. Reads ``pin`` one generation for their duration and ``unpin`` it after; a generation retired
   while pinned is freed by its last reader, so a read in flight always finishes consistently.
5. ``retire`` (run by ``publish``, ``find`` and lease changes) keeps the last ``keep`` numbers of
   each prefix and every generation with a live lease; the rest are dropped from the table (a new
   read gets ``GenerationRetired``) and from the disk, and freed once unpinned. ``drop`` removes a
   whole prefix (GEN_DROP), so the prefix table is never one that only an operator's rm empties.

At start the generations in the data directory are read back (generation_durable.py ``restore``:
each checked against the root digest recorded with it, numbered as it was; what cannot be restored
is set aside, and the server starts with the rest); "latest" is the newest of them; leases, which
belong to connections, do not survive a restart.

Who may drop a prefix (GEN_DROP, ``drop``): any client the server admits, while no other
connection (or gRPC peer) holds a live lease on one of its generations; its own leases end with
the drop. A lease is what a reader takes to keep a generation (a sharded checkpoint it is reading,
a rollback target): a drop must not pull it away from under it. Publishing cannot either: it never
retires a leased generation.

Peer-controlled state is bounded here: prefixes (``max_prefixes``; ``prefixes_per_client`` made by
one client host) and leases (generation_leases.py: ``leases_per_owner`` per connection,
``leases_per_client`` per client host; a lease lasts at most ``max_lease_seconds``, names a
generation by number, never "latest", and ends with its connection). Waiters and transactions
are bounded where they wait (generation_ops.py, generation_parts.py). Every refusal names the
``tensorwire serve`` flag that sets its bound (``FLAGS``). Called from the server's event loop only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tensorwire.errors import GenerationRetired, InvalidName, KeyNotFound, LimitExceeded, ProtocolError
from tensorwire.store.generation_config import DEFAULT_KEEP, SERVER_PREFIX, GenerationConfig, is_server_prefix
from tensorwire.store.generation_disk import GenerationDisk
from tensorwire.store.generation_durable import Durable
from tensorwire.store.generation_leases import Leases
from tensorwire.store.memory import Reservation, TensorStore
from tensorwire.types import ChunkSums, Generation, GenerationManifest, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire.generations import check_names
from tensorwire.wire.names import validate_name

__all__ = ["DEFAULT_KEEP", "SERVER_PREFIX", "GenerationConfig", "Generations", "Kept", "Sums", "check_names"]

Sums = Sequence[tuple[int, ...]]  # each tensor's chunk checksums, in its reservation's order


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
    durable: bool = False  # written to the data directory (removed from it when retired)
    # Its generation block (wg.encode_generation), made once for every wait it answers
    # (``announcement``): 4 bytes and a name per tensor, within the ``entry_cost`` each tensor's name
    # already counts against the capacity, so it needs no charge of its own.
    block: bytes = b""


@dataclass(eq=False)
class Prefix:
    latest: int = 0
    kept: dict[int, Kept] = field(default_factory=dict)  # number -> generation, oldest first
    client: str | None = None  # the client host that made it (None: the server, or a restart)

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
        self._leases = Leases(self.config, self._kept, clock)
        self._client_prefixes: Counter[str] = Counter()
        data_dir = store.data_dir
        self.disk = GenerationDisk(data_dir) if data_dir is not None else None
        # The data directory's side (generation_durable.py): None keeps generations in memory only.
        self.durable = Durable(self, self.disk) if self.disk is not None else None
        if self.durable is not None:
            self.durable.restore()

    def __len__(self) -> int:
        return len(self._prefixes)

    @property
    def generations(self) -> int:
        return sum(len(p.kept) for p in self._prefixes.values())

    @property
    def leases(self) -> int:
        return len(self._leases)

    @property
    def disk_errors(self) -> int:
        """Generations whose files could not be removed (logged; retired again at the next start)."""
        return self.durable.disk_errors if self.durable is not None else 0

    @property
    def quarantined(self) -> int:
        """Generations of the data directory set aside at start (logged)."""
        return self.durable.quarantined if self.durable is not None else 0

    def prefixes(self) -> list[str]:
        return list(self._prefixes)

    def newest(self, most: int = 64) -> dict[str, int]:
        """The newest generation number of (at most ``most``) prefixes, for STATUS."""
        return {prefix: p.latest for prefix, p in list(self._prefixes.items())[:most] if p.latest in p.kept}

    # -- publishing ----------------------------------------------------------------------------
    def admit(self, prefix: str, *, internal: bool = False, client: str | None = None) -> None:
        """InvalidName / LimitExceeded unless generations of ``prefix`` may be published (under
        ``SERVER_PREFIX`` only by the server itself: ``internal``; a new prefix by ``client``,
        its host, within its quota)."""
        validate_name(prefix)
        if not internal and is_server_prefix(prefix):
            raise InvalidName(f"prefix {prefix!r}: {SERVER_PREFIX!r} is the server's own")
        if prefix in self._prefixes:
            return
        self.check_nesting(prefix, "which has generations")
        limits = self.config
        if len(self._prefixes) >= limits.max_prefixes:
            have = f"{len(self._prefixes)} prefixes have generations already"
            raise LimitExceeded(f"{have}: {limits.most('max_prefixes')}")
        if client is not None and self._client_prefixes[client] >= limits.prefixes_per_client:
            have = f"this client ({client}) made {self._client_prefixes[client]} prefixes with generations"
            raise LimitExceeded(f"{have}: {limits.most('prefixes_per_client')}; GEN_DROP frees one")

    def prepare(
        self,
        prefix: str,
        res: Reservation,
        sums: Sums,
        number: int = 0,
        *,
        internal: bool = False,
        client: str | None = None,
    ) -> Kept:
        """``res`` (received and verified; ``sums`` its chunk checksums, in its order) kept and
        numbered as the prefix's next generation (``number`` where that is larger than the latest:
        a host leader numbers its share as its origin did, broadcast/host.py), not yet visible:
        ``install`` makes it so, ``discard`` gives it up. It owns ``res`` from here."""
        try:
            self.admit(prefix, internal=internal, client=client)
            check_names(prefix, [m.name for m in res.metas])
        except BaseException:
            self.store.abort(res)
            raise
        return self.numbered(prefix, res, sums, number)

    def check_nesting(self, prefix: str, why: str) -> None:
        """InvalidName if ``prefix`` nests in (or around) another prefix with generations: a name
        would lie under both (``why`` says of the other one)."""
        for other in self._prefixes:
            if prefix != other and (prefix.startswith(other + "/") or other.startswith(prefix + "/")):
                raise InvalidName(f"prefix {prefix!r} nests with {other!r}, {why}")

    def numbered(self, prefix: str, res: Reservation, sums: Sums, number: int) -> Kept:
        """``prepare`` once admitted (and at start, where nothing is admitted: ``Durable.restore``)."""
        self.store.keep(res)
        entry = self._prefixes.get(prefix)
        number = max(number, (entry.latest if entry is not None else 0) + 1)
        pairs = sorted(zip(res.metas, res.buffers, sums, strict=True), key=lambda p: p[0].name)
        chunk_sums = tuple(ChunkSums(m.with_version(number), s) for m, _, s in pairs)
        digest = wg.root_digest(chunk_sums, wg.CHUNK_BYTES, wg.CHECKSUM_KIND)
        names = tuple(m.name for m, _, _ in pairs)
        gen = Generation(prefix, number, digest, names, sum(m.nbytes for m in res.metas))
        tensors = {m.name: (m.with_version(number), b) for m, b, _ in pairs}
        return Kept(gen, tensors, chunk_sums, res)

    def install(self, kept: Kept, client: str | None = None) -> Generation:
        """Make a prepared generation visible (the newest of its prefix) and retire what it
        replaces. Admitted again: a prefix may have been made (or dropped) meanwhile."""
        try:
            self.admit(kept.generation.prefix, internal=True, client=client)
        except BaseException:
            self.discard(kept)
            raise
        return self.installed(kept, client)

    def installed(self, kept: Kept, client: str | None = None) -> Generation:
        """``install`` once admitted (and at start: ``Durable.restore``)."""
        gen = kept.generation
        entry = self._prefixes.get(gen.prefix)
        if entry is None:
            entry = self._prefixes[gen.prefix] = Prefix(client=client)
            if client is not None:
                self._client_prefixes[client] += 1
        entry.kept[gen.number] = kept
        entry.latest = max(entry.latest, gen.number)
        self.retire(gen.prefix)
        return gen

    def discard(self, kept: Kept) -> None:
        """A prepared generation that is not installed (its write failed): its memory goes."""
        kept.retired = True
        self.store.free_kept(kept.reservation)

    def publish(
        self,
        prefix: str,
        res: Reservation,
        sums: Sums,
        number: int = 0,
        *,
        internal: bool = False,
        client: str | None = None,
    ) -> Generation:
        """``prepare`` and ``install`` at once, in memory only: the server's own generations
        (``internal``), and every generation of a store without a data directory."""
        return self.install(self.prepare(prefix, res, sums, number, internal=internal, client=client), client)

    async def publish_durable(
        self, prefix: str, res: Reservation, sums: Sums, number: int = 0, *, client: str | None = None
    ) -> Generation:
        """``publish``, written to the data directory first when there is one (module docstring,
        step 3): PersistenceError, and nothing visible, if it cannot be written."""
        if self.durable is None:
            return self.publish(prefix, res, sums, number, client=client)
        return await self.durable.publish(prefix, res, sums, number, client)

    # -- reading -------------------------------------------------------------------------------
    def latest(self, prefix: str) -> Generation | None:
        entry = self._prefixes.get(prefix)
        if entry is None or entry.latest not in entry.kept:
            return None
        return entry.kept[entry.latest].generation

    def announcement(self, prefix: str, after: int) -> bytes | None:
        """The generation block of the newest generation of ``prefix`` if it is past ``after``:
        encoded once per generation, however many waiters it wakes."""
        entry = self._prefixes.get(prefix)
        kept = entry.kept.get(entry.latest) if entry is not None else None
        if kept is None or kept.generation.number <= after:
            return None
        if not kept.block:
            kept.block = wg.encode_generation(kept.generation)
        return kept.block

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
    def lease(
        self, owner: object, prefix: str, number: int, seconds: float, *, client: str = ""
    ) -> tuple[float, int]:
        """Keep generation ``number`` for ``owner`` (a connection; ``client`` its host) for
        ``seconds`` (at most ``max_lease_seconds``; 0 releases ``owner``'s own lease, no one
        else's); returns the seconds granted and the oldest generation kept. ``number`` names a
        generation: 0 ("latest") is refused, since a lease on whatever is newest would move."""
        if number == wg.LATEST:
            raise ProtocolError(
                f"a lease names a generation of {prefix!r} by its number, not 'latest' (0): read the"
                " newest one's number first (GEN_MANIFEST, GEN_WAIT)"
            )
        key = (prefix, number)
        if seconds <= 0:
            self._leases.end(owner, key)
            self.retire(prefix)
            return 0.0, self._oldest(prefix)
        granted = self._leases.grant(owner, key, self.find(prefix, number), seconds, client)
        return granted, self._oldest(prefix)

    def drop_owner(self, owner: object) -> None:
        """A connection ended: its leases end with it."""
        for prefix in self._leases.drop_owner(owner):
            self.retire(prefix)

    def _kept(self, prefix: str, number: int) -> Kept | None:
        entry = self._prefixes.get(prefix)
        return entry.kept.get(number) if entry is not None else None

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
                    self._leases.end(owner, (prefix, number))
            if not kept.leases:
                del entry.kept[number]
                self._retired(kept)

    async def drop(self, prefix: str, owner: object = None) -> int:
        """GEN_DROP from ``owner`` (a connection): every generation of ``prefix`` and the prefix
        itself go, at once, and from the data directory before this returns; those being read are
        freed by their last reader, ``owner``'s own leases on them end. Returns how many
        generations went; KeyNotFound if it has none (a prefix of the server's own,
        ``SERVER_PREFIX``, is not a client's to drop); NotAuthorized, and nothing changed, while
        another owner holds a live lease on one of them (module docstring: who may drop)."""
        validate_name(prefix)
        if is_server_prefix(prefix):
            raise KeyNotFound(f"prefix {prefix!r} has no generations a client may drop")
        if self.durable is None:
            return self._drop(prefix, owner)
        async with self.durable.writing:  # not while a publish of it is being written
            count = self._drop(prefix, owner)
            await self.durable.remove_prefix(prefix)
        return count

    def _drop(self, prefix: str, owner: object) -> int:
        entry = self._prefixes.get(prefix)
        if entry is None:
            raise KeyNotFound(f"prefix {prefix!r} has no generations")
        self._leases.check_droppable(prefix, owner, entry.kept)
        return self._forget(prefix)[0]

    def forget(self, prefix: str) -> None:
        """Drop every generation of ``prefix`` and the prefix (its owner ended, a parameter-server
        job say); those being read are freed by their last reader. Leases on them end."""
        _, durable = self._forget(prefix)
        if durable and self.durable is not None:
            self.durable.remove_later(self.durable.disk.remove_prefix, prefix)

    def _forget(self, prefix: str) -> tuple[int, bool]:
        """Drop ``prefix`` from memory: how many generations it had, and whether any was durable."""
        entry = self._prefixes.pop(prefix, None)
        if entry is None:
            return 0, False
        if entry.client is not None:
            self._client_prefixes[entry.client] -= 1
            if self._client_prefixes[entry.client] <= 0:
                del self._client_prefixes[entry.client]
        for owner, key in self._leases.holders(prefix):
            self._leases.end(owner, key)
        count, durable = len(entry.kept), any(kept.durable for kept in entry.kept.values())
        self._free(entry)
        return count, durable

    def close(self) -> None:
        """The server stops: free every generation not being read (their files stay)."""
        for entry in self._prefixes.values():
            self._free(entry)

    def _retired(self, kept: Kept) -> None:
        self._let_go(kept)
        if kept.durable and self.durable is not None:
            gen = kept.generation
            self.durable.remove_later(self.durable.disk.remove, gen.prefix, gen.number)

    def _free(self, entry: Prefix) -> None:
        for kept in entry.kept.values():
            self._let_go(kept)
        entry.kept.clear()

    def _let_go(self, kept: Kept) -> None:
        """Out of the table: its memory goes now, or with its last reader (``unpin``)."""
        kept.retired = True
        if kept.pins == 0:
            self.store.free_kept(kept.reservation)
