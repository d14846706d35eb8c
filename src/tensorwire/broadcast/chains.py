"""The origin's table of relays: for each generation of a prefix, who reads it from whom.

Pure bookkeeping, no I/O (the coordinator, coordinator.py, serves it). Readers of one generation
form pipelined chains: a new reader's upstream is the last reader that joined, until a chain is
``max_chain`` long; then a new chain starts at the origin (reader id 0). So the origin sends each
chunk once per chain, and a reader is at most ``max_chain`` hops from it.

Who may change the table: every registration belongs to an ``Owner`` (the connection that made it,
coordinator.py). Only its owner may report on it (DONE, FAILED, LEAVE: ``owned``), its address is
registered by no other owner while it lives, and it goes when its owner does (``drop_owner``: the
connection closed), so no table waits for a restart to empty.

A reader that reports its upstream failed reads from the origin from then on, not from the failed
one's own upstream (which may be failing too: fake readers joined one after another would cost an
honest reader one stall each), and an owner drops at most one upstream per generation (a hostile
reader cannot report its way through a chain of honest ones). A reader that has itself reported
its upstream in this generation is not dropped by the first report against it: it was waiting on
that upstream, so the readers behind it were too (one stalled peer would otherwise cost a whole
chain of honest readers their place); a second report drops it.

Every table is bounded: ``max_readers`` registered readers per generation (more still read, from
the origin, unregistered), ``max_per_owner`` prefixes an owner holds registrations under (one
each: a join replaces the owner's earlier registration under the prefix; more is LimitExceeded),
``keep`` generations per prefix (older ones are retired with their readers), ``max_prefixes``
prefix tables. Only a registration makes a table (a join that registers nothing reads from the
origin and leaves no trace), and a new table takes the place of the least recently joined table
with no live reader, never of one with readers: when every table has some, the new prefix's
readers read from the origin, unregistered, until one empties. So no one can evict another
prefix's relay (a parameter-server job's ``_ps/<job>`` included) by joining many prefixes.

Parameter-server sessions admitted to relay under a restricted prefix (``admit``: a live worker's
PS_RELAY) are kept here too, the last ``MAX_SESSIONS`` of them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from tensorwire.errors import InvalidName, LimitExceeded
from tensorwire.wire import relay as wr

ORIGIN = 0  # the upstream id of a reader that pulls from the origin itself
MAX_SESSIONS = 4096  # (prefix, session) admissions kept, the most recently admitted


@dataclass(eq=False)
class Owner:
    """One party that registers readers (a connection to the origin): what it holds, by prefix."""

    held: dict[str, tuple[int, int]] = field(default_factory=dict)  # prefix -> (generation, reader id)
    drops: dict[str, int] = field(default_factory=dict)  # prefix -> the generation it last dropped in


@dataclass(slots=True, eq=False)
class Reader:
    id: int
    address: str
    upstream: int
    depth: int  # hops from the origin when it joined
    owner: Owner
    done: bool = False
    rerouted: bool = False  # it reported its own upstream failed in this generation


@dataclass(slots=True)
class Generation:
    """One generation's relay: its readers in join order, and what the origin served for it."""

    manifest: wr.Manifest
    readers: dict[int, Reader] = field(default_factory=dict)
    served: int = 0  # data bytes the origin sent for it (RELAY_GET)
    joined: int = 0  # RELAY_JOINs answered for it, registered or not
    dropped: int = 0  # readers routed around: reported failed, or gone before they were done

    def placement(self, reader: Reader | None) -> wr.Placement:
        if reader is None:
            return wr.Placement(0, ORIGIN, "")
        upstream = self.readers.get(reader.upstream)
        return wr.Placement(reader.id, reader.upstream, upstream.address if upstream else "")

    def stats(self) -> dict[str, int]:
        return {
            "generation": self.manifest.generation,
            "model_bytes": self.manifest.nbytes,
            "served_bytes": self.served,
            "readers": len(self.readers),
            "done": sum(r.done for r in self.readers.values()),
            "joined": self.joined,
            "dropped": self.dropped,
        }


class Chains:
    """The relays of every prefix (see the module docstring)."""

    def __init__(
        self,
        max_readers: int = 256,
        max_chain: int = 32,
        keep: int = 2,
        max_prefixes: int = 64,
        max_per_owner: int = 4,
    ) -> None:
        if min(max_readers, max_chain, keep, max_prefixes, max_per_owner) < 1:
            raise ValueError("relay bounds must be at least 1")
        self.max_readers = max_readers
        self.max_chain = max_chain
        self.keep = keep
        self.max_prefixes = max_prefixes
        self.max_per_owner = max_per_owner
        self._prefixes: OrderedDict[str, OrderedDict[int, Generation]] = OrderedDict()
        self._addresses: dict[str, Reader] = {}  # every registered address, to its reader
        self._ids = itertools.count(1)
        self._sessions: OrderedDict[tuple[str, int], None] = OrderedDict()  # admitted, newest last
        self.served_total: dict[str, int] = {}  # per prefix, retired generations included

    def generation(self, prefix: str, manifest: wr.Manifest, *, make: bool = True) -> Generation | None:
        """The relay of ``manifest``'s generation, made (and older ones retired) on first use; None
        when the prefix has no table and either ``make`` is false or no table may make room (every
        one has live readers: see the module docstring)."""
        gens = self._prefixes.get(prefix)
        if gens is None:
            if not make or not self._make_room():
                return None
            gens = self._prefixes[prefix] = OrderedDict()
        self._prefixes.move_to_end(prefix)
        known = gens.get(manifest.generation)
        if known is not None:
            return known
        gen = gens[manifest.generation] = Generation(manifest)
        for number in sorted(gens)[: max(len(gens) - self.keep, 0)]:
            self._retire(gens.pop(number))
        return gen

    def _make_room(self) -> bool:
        """Room for one more prefix table: the least recently joined table without a live reader
        goes if all ``max_prefixes`` are taken; False if every one has readers (none is evicted)."""
        if len(self._prefixes) < self.max_prefixes:
            return True
        empty = next((p for p, gens in self._prefixes.items() if not _live(gens)), None)
        if empty is None:
            return False
        for stale in self._prefixes.pop(empty).values():
            self._retire(stale)
        self.served_total.pop(empty, None)
        return True

    # -- admissions under restricted prefixes -----------------------------------------------------
    def admit(self, prefix: str, session: int) -> None:
        """``session`` (a parameter-server worker's incarnation) may register under ``prefix``."""
        key = (prefix, session)
        self._sessions.pop(key, None)
        self._sessions[key] = None
        while len(self._sessions) > MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]

    def admitted(self, prefix: str, session: int) -> bool:
        return bool(session) and (prefix, session) in self._sessions

    def forget(self, prefix: str) -> None:
        """``prefix`` is gone (a job ended): its admissions go."""
        for key in [k for k in self._sessions if k[0] == prefix]:
            del self._sessions[key]

    def find(self, prefix: str, generation: int) -> Generation | None:
        gens = self._prefixes.get(prefix)
        return gens.get(generation) if gens is not None else None

    def join(self, prefix: str, gen: Generation, address: str, owner: Owner) -> Reader | None:
        """Register ``owner``'s reader relaying at ``address`` (None: not registered, it reads from
        the origin); ``owner``'s earlier registration under the prefix leaves first (its memory now
        receives this generation). InvalidName if another owner registered ``address``,
        LimitExceeded if ``owner`` holds ``max_per_owner`` prefixes already."""
        gen.joined += 1
        self.release(owner, prefix)
        if not address:
            return None
        if address in self._addresses:
            raise InvalidName(f"relay address {address} is registered by another connection")
        if len(owner.held) >= self.max_per_owner:
            raise LimitExceeded(
                f"this connection relays {len(owner.held)} prefixes already, the most one connection may"
                f" (the coordinator's max_per_owner): relay another prefix over a connection of its own"
            )
        if len(gen.readers) >= self.max_readers:
            return None
        tail = next(reversed(gen.readers.values()), None)
        if tail is None or tail.depth >= self.max_chain:
            upstream, depth = ORIGIN, 1
        else:
            upstream, depth = tail.id, tail.depth + 1
        reader = Reader(next(self._ids), address, upstream, depth, owner)
        gen.readers[reader.id] = reader
        owner.held[prefix] = (gen.manifest.generation, reader.id)
        self._addresses[address] = reader
        return reader

    @staticmethod
    def owned(gen: Generation, reader_id: int, owner: Owner) -> Reader | None:
        """Reader ``reader_id`` if ``owner`` registered it (None if it is not registered)."""
        reader = gen.readers.get(reader_id)
        return reader if reader is not None and reader.owner is owner else None

    def failed(self, prefix: str, gen: Generation, reader: Reader, upstream: int) -> wr.Placement:
        """``reader`` could not read from ``upstream``: drop that one (only if it really is the
        reader's upstream, only one per owner and generation, and not an upstream that was itself
        rerouted in this generation, the first time: the module docstring) and answer the origin."""
        owner, number = reader.owner, gen.manifest.generation
        reader.rerouted = reader.rerouted or reader.upstream != ORIGIN  # it waited on a peer
        target = gen.readers.get(upstream) if reader.upstream == upstream else None
        if target is not None and owner.drops.get(prefix) != number:
            self._drop(prefix, gen, target, owner)
        reader.upstream, reader.depth = ORIGIN, 1
        return gen.placement(reader)

    def _drop(self, prefix: str, gen: Generation, upstream: Reader, owner: Owner) -> None:
        if upstream.rerouted:  # it waited on a failed upstream itself: spared once
            upstream.rerouted = False
            return
        self.leave(gen, upstream.id)
        gen.dropped += 1
        owner.drops.pop(prefix, None)
        owner.drops[prefix] = gen.manifest.generation
        while len(owner.drops) > self.max_prefixes:  # bounded as the prefixes are
            del owner.drops[next(iter(owner.drops))]

    def leave(self, gen: Generation, reader_id: int) -> None:
        """Take a reader out; those that read from it read from its upstream instead."""
        gone = gen.readers.pop(reader_id, None)
        if gone is None:
            return
        self._unindex(gone)
        for reader in gen.readers.values():
            if reader.upstream == reader_id:
                reader.upstream = gone.upstream

    def release(self, owner: Owner, prefix: str) -> None:
        """``owner``'s registration under ``prefix`` leaves, whichever generation it is in."""
        held = owner.held.pop(prefix, None)
        if held is not None:
            gen = self.find(prefix, held[0])
            if gen is not None and self.owned(gen, held[1], owner) is not None:
                self.leave(gen, held[1])

    def drop_owner(self, owner: Owner) -> None:
        """``owner`` is gone (its connection closed): its readers leave; those not done yet count
        as dropped (their readers are routed around them)."""
        for prefix, (number, reader_id) in list(owner.held.items()):
            gen = self.find(prefix, number)
            reader = self.owned(gen, reader_id, owner) if gen is not None else None
            if gen is not None and reader is not None:
                gen.dropped += not reader.done
                self.leave(gen, reader_id)
        owner.held.clear()
        owner.drops.clear()

    def _retire(self, gen: Generation) -> None:
        for reader in gen.readers.values():
            self._unindex(reader)

    def _unindex(self, reader: Reader) -> None:
        """Forget ``reader``'s address and its owner's record of it."""
        if self._addresses.get(reader.address) is reader:
            del self._addresses[reader.address]
        for prefix, held in list(reader.owner.held.items()):
            if held[1] == reader.id:
                del reader.owner.held[prefix]

    def count_served(self, prefix: str, gen: Generation | None, nbytes: int) -> None:
        if gen is not None:
            gen.served += nbytes
        if prefix in self._prefixes:
            self.served_total[prefix] = self.served_total.get(prefix, 0) + nbytes

    def stats(self, prefix: str) -> dict[str, object]:
        gens: Mapping[int, Generation] = self._prefixes.get(prefix, {})
        return {
            "prefix": prefix,
            "served_bytes": self.served_total.get(prefix, 0),
            "generations": [gen.stats() for gen in gens.values()],
        }

    def totals(self) -> dict[str, int]:
        return dict(self.served_total)

    def readers(self) -> int:
        return sum(len(g.readers) for gens in self._prefixes.values() for g in gens.values())

    def addresses(self) -> int:
        """Addresses registered (one per registered reader: the index is kept in step)."""
        return len(self._addresses)

    def readers_by_prefix(self) -> dict[str, int]:
        """Each prefix's readers (of all its generations held), for STATUS (the dashboard)."""
        return {p: sum(len(g.readers) for g in gens.values()) for p, gens in list(self._prefixes.items())}


def _live(gens: Mapping[int, Generation]) -> bool:
    """Whether a prefix's table has a registered reader in any generation it holds."""
    return any(gen.readers for gen in gens.values())
