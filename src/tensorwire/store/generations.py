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
   publish has returned, its generation survives a kill -9. A server's own generations
   (``SERVER_PREFIX``, a parameter server's relay copies) are memory-only: they are made again
   from the job's state.
4. Reads ``pin`` one generation for their duration and ``unpin`` it after; a generation retired
   while pinned is freed by its last reader, so a read in flight always finishes consistently.
5. ``retire`` (run by ``publish``, ``find`` and lease changes) keeps the last ``keep`` numbers of
   each prefix and every generation with a live lease; the rest are dropped from the table (a new
   read gets ``GenerationRetired``) and from the disk, and freed once unpinned. ``drop`` removes a
   whole prefix (GEN_DROP), so the prefix table is never one that only an operator's rm empties.

At start the generations in the data directory are read back (each checked against the root
digest recorded with it), numbered as they were; "latest" is the newest of them; leases, which
belong to connections, do not survive a restart. Restoring is not publishing: the bounds a client's
publish is admitted under (``max_prefixes``, ``prefixes_per_client``) do not apply to what the
server kept (an operator who lowers a bound gets no new prefix until there is room, never a server
that cannot start). A generation that cannot be restored (damaged, or a prefix that nests with
another's) is set aside (generation_disk.py ``quarantine``), logged and counted (``quarantined``),
and the server starts with the rest. A publish given up during its write (its connection closed,
the server stopping) leaves nothing on disk (generation_disk.py ``Ticket``): a publisher told it
failed never finds its generation back after a restart.

Who may drop a prefix (GEN_DROP, ``drop``): any client the server admits, while no other
connection (or gRPC peer) holds a live lease on one of its generations; its own leases end with
the drop. A lease is what a reader takes to keep a generation (a sharded checkpoint it is reading,
a rollback target): a drop must not pull it away from under it. Publishing cannot either: it never
retires a leased generation.

Peer-controlled state is bounded here: prefixes (``max_prefixes``; ``prefixes_per_client`` made by
one client host) and leases (``leases_per_owner`` per connection, ``leases_per_client`` per client
host; a lease lasts at most ``max_lease_seconds``, names a generation by number, never "latest",
and ends with its connection). Waiters and transactions are bounded where they wait
(generation_ops.py, generation_parts.py). Every refusal names the ``tensorwire serve`` flag that
sets its bound (``FLAGS``). Called from the server's event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import pathlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tensorwire.errors import (
    CapacityExceeded,
    GenerationRetired,
    InvalidName,
    KeyNotFound,
    LimitExceeded,
    NotAuthorized,
    PersistenceError,
    ProtocolError,
    TensorwireError,
)
from tensorwire.logs import event
from tensorwire.store.generation_config import DEFAULT_KEEP, SERVER_PREFIX, GenerationConfig, is_server_prefix
from tensorwire.store.generation_disk import GenerationDisk, StoredGeneration, Ticket
from tensorwire.store.memory import Reservation, TensorStore
from tensorwire.types import ChunkSums, Generation, GenerationManifest, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire.names import validate_name

__all__ = ["DEFAULT_KEEP", "SERVER_PREFIX", "GenerationConfig", "Generations", "Kept", "check_names"]

log = logging.getLogger("tensorwire.store.generations")


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


LeaseKey = tuple[str, int]  # (prefix, number)


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
        self._leases: dict[object, set[LeaseKey]] = {}  # owner -> its leases
        self._owner_client: dict[object, str] = {}  # owner -> its client host
        self._client_leases: Counter[str] = Counter()
        self._client_prefixes: Counter[str] = Counter()
        self.disk_errors = 0  # retired generations whose files could not be removed (logged)
        self.quarantined = 0  # generations of the data directory set aside at start (logged)
        self._removals: set[asyncio.Task[None]] = set()
        self._writing: asyncio.Lock | None = None  # one durable publish at a time (made on a loop)
        data_dir = store.data_dir
        self.disk = GenerationDisk(data_dir) if data_dir is not None else None
        if self.disk is not None:
            self._load(self.disk)

    def __len__(self) -> int:
        return len(self._prefixes)

    @property
    def generations(self) -> int:
        return sum(len(p.kept) for p in self._prefixes.values())

    @property
    def leases(self) -> int:
        return sum(len(held) for held in self._leases.values())

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
        for other in self._prefixes:
            if prefix.startswith(other + "/") or other.startswith(prefix + "/"):
                raise InvalidName(f"prefix {prefix!r} nests with {other!r}, which has generations")
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
        sums: Sequence[tuple[int, ...]],
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
        return self._numbered(prefix, res, sums, number)

    def _numbered(self, prefix: str, res: Reservation, sums: Sequence[tuple[int, ...]], number: int) -> Kept:
        """``prepare`` once admitted (and at start, where nothing is admitted: ``_restore``)."""
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
        return self._installed(kept, client)

    def _installed(self, kept: Kept, client: str | None = None) -> Generation:
        """``install`` once admitted (and at start: ``_restore``)."""
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
        sums: Sequence[tuple[int, ...]],
        number: int = 0,
        *,
        internal: bool = False,
        client: str | None = None,
    ) -> Generation:
        """``prepare`` and ``install`` at once, in memory only: the server's own generations
        (``internal``), and every generation of a store without a data directory."""
        return self.install(self.prepare(prefix, res, sums, number, internal=internal, client=client), client)

    async def publish_durable(
        self,
        prefix: str,
        res: Reservation,
        sums: Sequence[tuple[int, ...]],
        number: int = 0,
        *,
        client: str | None = None,
    ) -> Generation:
        """``publish``, written to the data directory first when there is one (module docstring,
        step 3): PersistenceError, and nothing visible, if it cannot be written."""
        if self.disk is None:
            return self.publish(prefix, res, sums, number, client=client)
        if self._writing is None:
            self._writing = asyncio.Lock()
        try:
            await self._writing.acquire()  # numbers are handed out and written in the same order
        except BaseException:
            self.store.abort(res)  # cancelled while another publish was being written
            raise
        try:
            kept = self.prepare(prefix, res, sums, number, client=client)
            await self._write(self.disk, kept)
            kept.durable = True
            try:
                return self.install(kept, client)
            except Exception:  # refused after all (a bound reached meanwhile): its files go too,
                # before the next publish (which may take the same number) is written
                with contextlib.suppress(PersistenceError):
                    await self.store.call(self.disk.remove, prefix, kept.generation.number)
                raise
        finally:
            self._writing.release()

    async def _write(self, disk: GenerationDisk, kept: Kept) -> None:
        pairs = [kept.tensors[name] for name in kept.generation.names]
        ticket = Ticket()
        write = asyncio.ensure_future(self.store.call(disk.write, kept.generation, pairs, ticket))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            # Given up (its connection closed, the server stops): its publisher hears it failed, so
            # the generation must not come back at the next start. The disk thread stops before
            # the rename; had it renamed it already, it goes now (on this thread: the server may be
            # stopping, and a removal queued behind it might never run). The disk thread still
            # reads the buffers: they go back to the pool once it is done.
            if ticket.abandon():
                self._remove_abandoned(disk, kept.generation)
            write.add_done_callback(functools.partial(self._abandoned, kept))
            raise
        except BaseException as exc:
            self.discard(kept)
            if isinstance(exc, PersistenceError):
                raise PersistenceError(f"generation {kept.generation.number} of {kept.generation.prefix!r}"
                                       f" not published: {exc}") from exc  # fmt: skip
            raise

    def _abandoned(self, kept: Kept, write: asyncio.Future[None]) -> None:
        """The disk thread is done with a generation whose publish was given up: its buffers go
        (the write's outcome is nobody's now: it stopped short, or was removed)."""
        if not write.cancelled():
            write.exception()  # retrieved: asyncio would log it as lost
        self.discard(kept)

    def _remove_abandoned(self, disk: GenerationDisk, gen: Generation) -> None:
        try:
            disk.remove(gen.prefix, gen.number)
        except PersistenceError as exc:
            self.disk_errors += 1
            event(log, logging.ERROR, "a generation whose publish was given up is left on disk; it is"
                  " restored at the next start unless removed", prefix=gen.prefix, number=gen.number,
                  error=str(exc))  # fmt: skip

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
            self._end_lease(owner, key)
            self.retire(prefix)
            return 0.0, self._oldest(prefix)
        kept = self.find(prefix, number)
        fresh = key not in self._leases.get(owner, ())
        if fresh:
            self._check_lease_room(owner, client)
        granted = min(seconds, self.config.max_lease_seconds)
        kept.leases[owner] = self.clock() + granted
        if fresh:  # counted only once granted: a refused owner leaves nothing in the tables
            self._leases.setdefault(owner, set()).add(key)
            self._owner_client[owner] = client
            self._client_leases[client] += 1
        return granted, self._oldest(prefix)

    def _check_lease_room(self, owner: object, client: str) -> None:
        limits = self.config
        self._forget_expired(owner)
        held = len(self._leases.get(owner, ()))
        if held >= limits.leases_per_owner:
            have = f"this connection holds {held} leases"
            raise LimitExceeded(f"{have}: {limits.most('leases_per_owner')}")
        if self._client_leases[client] >= limits.leases_per_client:
            for other in [o for o, c in self._owner_client.items() if c == client]:
                self._forget_expired(other)
        if self._client_leases[client] >= limits.leases_per_client:
            have = f"this client ({client}) holds {self._client_leases[client]} leases"
            raise LimitExceeded(f"{have}: {limits.most('leases_per_client')}")

    def _forget_expired(self, owner: object) -> None:
        """End ``owner``'s leases that ran out (or whose generation is gone)."""
        now = self.clock()
        for key in list(self._leases.get(owner, ())):
            kept = self._kept(*key)
            if kept is None or kept.leases.get(owner, 0.0) <= now:
                self._end_lease(owner, key)

    def _end_lease(self, owner: object, key: LeaseKey) -> None:
        """``owner``'s lease on ``key`` ends (if it has one): the one place a lease is uncounted."""
        held = self._leases.get(owner)
        kept = self._kept(*key)
        if kept is not None:
            kept.leases.pop(owner, None)
        if held is None or key not in held:
            return
        held.discard(key)
        client = self._owner_client.get(owner, "")
        self._client_leases[client] -= 1
        if self._client_leases[client] <= 0:
            del self._client_leases[client]
        if not held:  # an owner is in the tables only while it holds a lease
            del self._leases[owner]
            self._owner_client.pop(owner, None)

    def drop_owner(self, owner: object) -> None:
        """A connection ended: its leases end with it."""
        keys = list(self._leases.get(owner, ()))
        for key in keys:
            self._end_lease(owner, key)
        self._leases.pop(owner, None)
        self._owner_client.pop(owner, None)
        for prefix in {prefix for prefix, _ in keys}:
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
                    self._end_lease(owner, (prefix, number))
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
        if self.disk is None:
            return self._drop(prefix, owner)
        if self._writing is None:
            self._writing = asyncio.Lock()
        async with self._writing:  # not while a publish of it is being written
            count = self._drop(prefix, owner)
            await self.store.call(self.disk.remove_prefix, prefix)
        return count

    def _drop(self, prefix: str, owner: object) -> int:
        entry = self._prefixes.get(prefix)
        if entry is None:
            raise KeyNotFound(f"prefix {prefix!r} has no generations")
        now = self.clock()
        leased = {number: sum(1 for who, end in kept.leases.items() if who is not owner and end > now)
                  for number, kept in entry.kept.items()}  # fmt: skip
        held = {number: count for number, count in leased.items() if count}
        if held:
            numbers = ", ".join(map(str, sorted(held)[:8]))
            raise NotAuthorized(
                f"cannot drop {prefix!r}: other connections hold {sum(held.values())} leases on its"
                f" generations ({numbers}); a prefix is dropped only when no one else holds one (they"
                " release them, close, or the leases run out: at most --max-lease-seconds)"
            )
        return self._forget(prefix)[0]

    def forget(self, prefix: str) -> None:
        """Drop every generation of ``prefix`` and the prefix (its owner ended, a parameter-server
        job say); those being read are freed by their last reader. Leases on them end."""
        _, durable = self._forget(prefix)
        if durable and self.disk is not None:
            self._on_disk(self.disk.remove_prefix, prefix)

    def _forget(self, prefix: str) -> tuple[int, bool]:
        """Drop ``prefix`` from memory: how many generations it had, and whether any was durable."""
        entry = self._prefixes.pop(prefix, None)
        if entry is None:
            return 0, False
        if entry.client is not None:
            self._client_prefixes[entry.client] -= 1
            if self._client_prefixes[entry.client] <= 0:
                del self._client_prefixes[entry.client]
        for owner, held in list(self._leases.items()):
            for key in [key for key in held if key[0] == prefix]:
                self._end_lease(owner, key)
        count, durable = len(entry.kept), any(kept.durable for kept in entry.kept.values())
        self._free(entry)
        return count, durable

    def close(self) -> None:
        """The server stops: free every generation not being read (their files stay)."""
        for entry in self._prefixes.values():
            self._free(entry)

    def _retired(self, kept: Kept) -> None:
        kept.retired = True
        if kept.pins == 0:
            self.store.free_kept(kept.reservation)
        if kept.durable and self.disk is not None:
            gen = kept.generation
            self._on_disk(self.disk.remove, gen.prefix, gen.number)

    def _free(self, entry: Prefix) -> None:
        for kept in entry.kept.values():
            kept.retired = True
            if kept.pins == 0:
                self.store.free_kept(kept.reservation)
        entry.kept.clear()

    def _on_disk(self, fn: Callable[..., None], *args: object) -> None:
        """Remove files on the store's disk thread, after every write queued before (at start,
        before any loop runs: at once). A failure is logged and counted: the files of a retired
        generation that stay are retired again at the next start."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            with contextlib.suppress(PersistenceError):
                fn(*args)
            return
        task = loop.create_task(self.store.call(fn, *args))
        self._removals.add(task)
        task.add_done_callback(self._removed)

    def _removed(self, task: asyncio.Task[None]) -> None:
        self._removals.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.disk_errors += 1
            event(log, logging.WARNING, "retired generation left on disk", error=str(task.exception()))

    # -- the data directory, at start ----------------------------------------------------------
    def _load(self, disk: GenerationDisk) -> None:
        """Every generation of the data directory back in memory, as it was published (what
        cannot be is set aside); then each prefix keeps its last ``keep`` (files of generations
        retired before a crash go now)."""
        set_aside = functools.partial(self._set_aside, disk)
        for stored in disk.load(set_aside):
            try:
                self._restore(stored)
            except CapacityExceeded:  # an operator's setting (--capacity, --max-tensors), not the data
                raise
            except TensorwireError as exc:  # damaged, or never publishable (a name, a nesting)
                set_aside(stored.path, exc)
        for prefix in list(self._prefixes):
            self.retire(prefix)
        if self._prefixes:
            event(log, logging.INFO, "generations restored", prefixes=len(self._prefixes),
                  generations=self.generations, bytes=self.store.kept)  # fmt: skip

    def _set_aside(self, disk: GenerationDisk, path: pathlib.Path, why: Exception) -> None:
        """What cannot be restored goes under the quarantine folder, loudly (PersistenceError
        naming it where it cannot be moved: the one case the server does not start)."""
        moved = disk.quarantine(path)
        self.quarantined += 1
        event(log, logging.ERROR, "generation set aside: it cannot be restored", path=str(path),
              moved_to=str(moved), reason=str(why))  # fmt: skip

    def _restore(self, stored: StoredGeneration) -> None:
        """One generation of the data directory back as it was kept: checked (a valid prefix, not
        nesting with another, its root digest as recorded), never admitted as a client's publish
        is (no quota of a client's applies: module docstring)."""
        self._check_restorable(stored.prefix)
        metas = [TensorMeta(m.name, m.dtype, m.shape, m.nbytes) for m, _ in stored.tensors]
        try:
            res = self.store.reserve(metas)
        except CapacityExceeded as exc:  # the server does not start: say which directory to remove
            where = f"restoring generation {stored.number} of {stored.prefix!r} from {stored.path}"
            raise CapacityExceeded(f"{exc}; {where} (remove it to start without it)") from exc
        try:
            check_names(stored.prefix, [m.name for m in metas])
            for buffer, (_, data) in zip(res.buffers, stored.tensors, strict=True):
                buffer.cast("B")[:] = data.numpy().data.cast("B")
            sums = [wg.chunk_checksums(b) for b in res.buffers]
        except BaseException:
            self.store.abort(res)
            raise
        kept = self._numbered(stored.prefix, res, sums, stored.number)
        gen = kept.generation
        if gen.number != stored.number or gen.digest != stored.digest:
            self.discard(kept)
            raise PersistenceError(
                f"generation {stored.number} of {stored.prefix!r} in the data directory does not read"
                " back as it was published (its root digest differs): the files are damaged"
            )
        kept.durable = True
        self._installed(kept)

    def _check_restorable(self, prefix: str) -> None:
        """InvalidName unless ``prefix`` could have been published (two prefixes that nest cannot
        both have generations: a name would lie under both)."""
        validate_name(prefix)
        if prefix in self._prefixes:
            return
        for other in self._prefixes:
            if prefix.startswith(other + "/") or other.startswith(prefix + "/"):
                raise InvalidName(f"prefix {prefix!r} nests with {other!r}, restored before it")


def check_names(prefix: str, names: Sequence[str]) -> None:
    """InvalidName unless every name is ``prefix/key`` (the names themselves are checked by the
    store's reservation)."""
    head = prefix + "/"
    for name in names:
        if not name.startswith(head):
            raise InvalidName(f"{name!r} is not under the prefix {prefix!r} it is published to")
