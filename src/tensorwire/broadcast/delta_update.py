"""A ``Subscriber``'s update as a delta from the origin, and the record of each update.

subscriber.py's module docstring ("Deltas") says when: a reader that holds generation ``b`` reads
a newer ``g`` from the origin itself as a delta read (``get_many(at=g, base=b)``;
client/deltas.py), applied in place and checked against ``g``'s chunk checksums, instead of joining
the relay. ``update`` answers the generation it brought, or why the relay should bring the whole
generation instead: the origin has no generations, or no longer keeps ``b``, or the delta read
failed (then the tensors may hold a mix, and the reader's ``generation`` says 0).

The reader is anything with the attributes and methods of ``DeltaReader`` (``Subscriber`` is one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, Protocol, TypeVar

import torch

from tensorwire.client import deltas as delta_reads
from tensorwire.errors import GenerationRetired, TensorwireError, VersionChanged
from tensorwire.logs import event
from tensorwire.transport.base import Transport, as_generational
from tensorwire.types import GenerationManifest, TensorMeta
from tensorwire.wire import generations as wg

T = TypeVar("T")
log = logging.getLogger("tensorwire.broadcast")


@dataclass(slots=True)
class UpdateRecord:
    """One ``update()``: the generation it brought, the one the tensors held before (0: none),
    ``way`` ("delta": from the origin with ``base``; "relay": the whole generation through the
    relay; "current": nothing newer), the data bytes it received, and why a delta read was given
    up for the relay (``fallback``, "" when it was not)."""

    generation: int
    base: int
    way: Literal["delta", "relay", "current"]
    bytes: int
    fallback: str = ""


class DeltaReader(Protocol):
    """What a delta update needs of its reader (``Subscriber`` is one)."""

    prefix: str
    generation: int  # the generation the tensors hold (0: none yet, or a mix)
    targets: dict[str, torch.Tensor]  # by full name
    updates: deque[UpdateRecord]
    delta_stats: delta_reads.DeltaStats

    def _bind(self, metas: Sequence[TensorMeta], generation: int) -> list[memoryview]: ...

    async def _stop_serving(self) -> None: ...

    async def _on_origin(self, op: Callable[[Transport], Awaitable[T]], idempotent: bool = True) -> T: ...


async def update(reader: DeltaReader, deadline: float) -> int | str:
    """The newest generation as a delta against the one held, from the origin: its number, or
    why the relay should bring the whole generation instead (the tensors then hold the base
    still, or ``reader.generation`` is 0: a failed delta read may have left them a mix)."""
    base = reader.generation
    try:
        latest = await _manifest(reader, wg.LATEST)
        if latest.generation.number != base:
            await _manifest(reader, base)  # GenerationRetired: the relay costs the origin less
    except TensorwireError as exc:  # e.g. an origin that relays plain tensors, not generations
        return _fell_back(reader, base, f"no delta from {base}: {exc!r}")
    number = latest.generation.number
    if number == base:
        reader.updates.append(UpdateRecord(base, base, "current", 0))
        return base
    reader._bind([entry.meta for entry in latest.tensors], number)  # nothing written if it raises
    await reader._stop_serving()  # the tensors are about to change
    return await _apply(reader, latest, base, deadline)


async def _manifest(reader: DeltaReader, number: int) -> GenerationManifest:
    return await reader._on_origin(lambda t: as_generational(t, "a delta").manifest(reader.prefix, number))


async def _apply(reader: DeltaReader, manifest: GenerationManifest, base: int, deadline: float) -> int | str:
    number, stats = manifest.generation.number, reader.delta_stats
    names = [entry.meta.name for entry in manifest.tensors]
    out = {name: reader.targets[name] for name in names}
    before = asdict(stats)
    reader.generation = 0  # the tensors are being overwritten
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
            await delta_reads.read(
                reader._on_origin, names, out, at=number, base=base, verify=False, stats=stats
            )
    except (TensorwireError, TimeoutError) as exc:
        # DeltaStats.reads counts an answer once it is in, before anything is applied.
        untouched = stats.reads == before["reads"]
        if untouched:
            reader.generation = base
            if isinstance(exc, GenerationRetired | VersionChanged):
                raise  # the Subscriber asks again for the newest
        return _fell_back(reader, base, f"the delta read to {number} failed: {exc!r}")
    reader.generation = number
    moved = stats.wire_bytes - before["wire_bytes"]
    reader.updates.append(UpdateRecord(number, base, "delta", moved))
    return number


def _fell_back(reader: DeltaReader, base: int, why: str) -> str:
    """Log why the relay brings the whole generation: a warning when the tensors no longer hold
    ``base`` (a delta read failed half-way), else (no generations, a retired base) info."""
    level = logging.WARNING if reader.generation != base else logging.INFO
    event(log, level, "delta update falls back to the relay", prefix=reader.prefix, base=base,
          holds=reader.generation, why=why)  # fmt: skip
    return why
