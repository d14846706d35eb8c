"""The origin's table of relays: for each generation of a prefix, who reads it from whom.

Pure bookkeeping, no I/O (the coordinator, coordinator.py, serves it). Readers of one generation
form pipelined chains: a new reader's upstream is the last reader that joined, until a chain is
``max_chain`` long; then a new chain starts at the origin (reader id 0). So the origin sends each
chunk once per chain, and a reader is at most ``max_chain`` hops from it.

Every table is bounded: ``max_readers`` registered readers per generation (more still read, from
the origin, unregistered), ``keep`` generations per prefix (older ones are retired with their
readers), ``max_prefixes`` prefixes (the least recently joined is dropped).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from tensorwire.wire import relay as wr

ORIGIN = 0  # the upstream id of a reader that pulls from the origin itself


@dataclass(slots=True)
class Reader:
    id: int
    address: str
    upstream: int
    depth: int  # hops from the origin when it joined
    done: bool = False


@dataclass(slots=True)
class Generation:
    """One generation's relay: its readers in join order, and what the origin served for it."""

    manifest: wr.Manifest
    readers: dict[int, Reader] = field(default_factory=dict)
    served: int = 0  # data bytes the origin sent for it (RELAY_GET)
    joined: int = 0  # RELAY_JOINs answered for it, registered or not
    dropped: int = 0  # readers routed around after a failure report

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
        self, max_readers: int = 256, max_chain: int = 32, keep: int = 2, max_prefixes: int = 64
    ) -> None:
        if min(max_readers, max_chain, keep, max_prefixes) < 1:
            raise ValueError("relay bounds must be at least 1")
        self.max_readers = max_readers
        self.max_chain = max_chain
        self.keep = keep
        self.max_prefixes = max_prefixes
        self._prefixes: OrderedDict[str, OrderedDict[int, Generation]] = OrderedDict()
        self._ids = itertools.count(1)
        self.served_total: dict[str, int] = {}  # per prefix, retired generations included

    def generation(self, prefix: str, manifest: wr.Manifest) -> Generation:
        """The relay of ``manifest``'s generation, made (and older ones retired) on first use."""
        gens = self._prefixes.get(prefix)
        if gens is None:
            gens = self._prefixes[prefix] = OrderedDict()
            while len(self._prefixes) > self.max_prefixes:
                dropped, _ = self._prefixes.popitem(last=False)
                self.served_total.pop(dropped, None)
        self._prefixes.move_to_end(prefix)
        gen = gens.get(manifest.generation)
        if gen is None:
            gen = gens[manifest.generation] = Generation(manifest)
            for old in sorted(gens)[: max(len(gens) - self.keep, 0)]:
                del gens[old]
        return gen

    def find(self, prefix: str, generation: int) -> Generation | None:
        gens = self._prefixes.get(prefix)
        return gens.get(generation) if gens is not None else None

    def join(self, prefix: str, gen: Generation, address: str) -> Reader | None:
        """Register a reader relaying at ``address`` (None: not registered, it reads from the
        origin). The same address in an older generation of the prefix leaves that one: its memory
        now receives this generation."""
        gen.joined += 1
        if not address or len(gen.readers) >= self.max_readers:
            return None
        for other in self._prefixes.get(prefix, {}).values():
            for reader in [r for r in other.readers.values() if r.address == address]:
                self.leave(other, reader.id)
        tail = next(reversed(gen.readers.values()), None)
        if tail is None or tail.depth >= self.max_chain:
            upstream, depth = ORIGIN, 1
        else:
            upstream, depth = tail.id, tail.depth + 1
        reader = Reader(next(self._ids), address, upstream, depth)
        gen.readers[reader.id] = reader
        return reader

    def failed(self, gen: Generation, reader_id: int, upstream: int) -> wr.Placement:
        """``reader_id`` could not read from ``upstream``: drop that one (only if it really is the
        reporter's upstream; a report cannot drop anyone else) and answer where to go now."""
        reader = gen.readers.get(reader_id)
        if reader is None:
            return gen.placement(None)
        if upstream != ORIGIN and reader.upstream == upstream:
            self.leave(gen, upstream)
            gen.dropped += 1
        return gen.placement(reader)

    def leave(self, gen: Generation, reader_id: int) -> None:
        """Take a reader out; those that read from it read from its upstream instead."""
        gone = gen.readers.pop(reader_id, None)
        if gone is None:
            return
        for reader in gen.readers.values():
            if reader.upstream == reader_id:
                reader.upstream = gone.upstream

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

    def readers_by_prefix(self) -> dict[str, int]:
        """Each prefix's readers (of all its generations held), for STATUS (the dashboard)."""
        return {p: sum(len(g.readers) for g in gens.values()) for p, gens in list(self._prefixes.items())}
