"""The answer to a GEN_GET_DELTA (docs/protocol.md §14, "Delta reads"), built from two pinned
generations: per chunk, ``delta.encode(base chunk, new chunk)`` when that is smaller, else the
full chunk.

Memory: a FULL chunk is sent from the kept generation's own bytes (a one-byte kind, then a view
of the chunk: no copy), so only the encoded deltas are held while the answer is sent, and at most
``budget`` bytes of them per answer; past it the remaining chunks go FULL. The encoded deltas
count against the store's capacity (``Charges``: ``TensorStore.hold``) until the answer is sent,
so many slow readers cannot hold more than ``--capacity`` between them: a delta that does not fit
is sent FULL instead (counted in ``Charges.refused``). A delta is kept only when smaller than its
chunk, so an answer is never larger than the full read plus one byte per chunk. Runs on a worker
thread for large reads; both generations are pinned by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tensorwire.errors import CapacityExceeded
from tensorwire.store.generations import Kept
from tensorwire.store.memory import TensorStore
from tensorwire.types import TensorMeta
from tensorwire.wire import delta
from tensorwire.wire import generations as wg
from tensorwire.wire.delta_reads import DeltaAnswer, TensorDelta

DEFAULT_BUDGET = 64 << 20  # encoded delta bytes one answer may hold
_FULL = memoryview(bytes([delta.Kind.FULL]))


@dataclass(slots=True)
class _Budget:
    left: int
    charges: Charges | None


@dataclass(eq=False)
class Charges:
    """The encoded deltas of one answer, counted against ``store``'s capacity until ``release``
    (after the answer is sent). Thread-safe as the store is: ``build`` runs on a worker thread."""

    store: TensorStore
    releases: list[Callable[[], None]] = field(default_factory=list)
    refused: int = 0  # deltas sent FULL because the store had no room for them

    def take(self, nbytes: int) -> bool:
        try:
            self.releases.append(self.store.hold(nbytes))
        except CapacityExceeded:
            self.refused += 1
            return False
        return True

    def release(self) -> None:
        for release in self.releases:
            release()
        self.releases.clear()


def build(
    new: Kept,
    base: Kept | None,
    pairs: Sequence[tuple[TensorMeta, memoryview]],
    budget: int = DEFAULT_BUDGET,
    charges: Charges | None = None,
) -> tuple[DeltaAnswer, list[memoryview]]:
    """The answer's block contents and its data (views, in order) for ``pairs`` (tensors of
    ``new``); each delta kept is taken from ``charges`` (released by the caller once sent)."""
    sums = {entry.meta.name: entry.checksums for entry in new.sums}
    left = _Budget(budget, charges)
    data: list[memoryview] = []
    tensors = []
    for meta, view in pairs:
        old = _base_of(base, meta)
        lengths = _chunks(meta, view, old, left, data)
        tensors.append(TensorDelta(meta, lengths, sums[meta.name]))
    gen = new.generation
    used = base.generation.number if base is not None else 0
    kind, chunk = int(wg.CHECKSUM_KIND), wg.CHUNK_BYTES
    return DeltaAnswer(gen.prefix, gen.number, gen.digest, used, kind, chunk, tuple(tensors)), data


def _base_of(base: Kept | None, meta: TensorMeta) -> memoryview | None:
    """The tensor's bytes in the base generation, if it is there with the same dtype and shape."""
    pair = base.tensors.get(meta.name) if base is not None else None
    if pair is None or pair[0].dtype != meta.dtype or pair[0].shape != meta.shape:
        return None
    return pair[1]


def _chunks(
    meta: TensorMeta, view: memoryview, old: memoryview | None, left: _Budget, data: list[memoryview]
) -> tuple[int, ...]:
    """Append each chunk's delta (or FULL form) to ``data``; return their lengths."""
    itemsize = meta.dtype.itemsize
    lengths = []
    for start in range(0, meta.nbytes, wg.CHUNK_BYTES):
        chunk = view[start : start + wg.CHUNK_BYTES]
        encoded = None
        if old is not None and left.left > 0:
            encoded = delta.encode_smaller(old[start : start + wg.CHUNK_BYTES], chunk, itemsize)
        if encoded is not None and left.charges is not None and not left.charges.take(len(encoded)):
            encoded = None  # no room to hold it while it is sent: the chunk itself (no copy)
        if encoded is not None:
            left.left -= len(encoded)
            data.append(memoryview(encoded))
            lengths.append(len(encoded))
        else:  # the chunk itself, from the kept generation (no copy)
            data += (_FULL, chunk)
            lengths.append(1 + chunk.nbytes)
    return tuple(lengths)
