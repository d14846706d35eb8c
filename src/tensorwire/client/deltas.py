"""Delta reads (README, "Deltas"; docs/protocol.md §14): ``get_many(names, at=g, base=b, out=)``
where ``out`` holds generation ``b`` of every name. The server answers each chunk with a delta
against ``b`` or the full chunk (all full when it no longer keeps ``b``); each is applied in place
into ``out`` with ``delta.apply_checked``, so a chunk is only taken when its checksum is the new
chunk's. A chunk whose delta does not check out (``out`` did not really hold ``b``) is left as it
was and fetched again in full with a range read, counted in ``DeltaStats.refetched`` and logged:
the result is generation ``g``, bit-exact, either way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tensorwire.client.generations import At, Run, at_number, verify_read
from tensorwire.errors import CorruptFrame, DigestMismatch, InvalidTensor, ProtocolError
from tensorwire.transport.base import Generational, Transport, as_generational
from tensorwire.types import TensorMeta
from tensorwire.wire import delta
from tensorwire.wire import delta_reads as dr
from tensorwire.wire.checksum import checksum
from tensorwire.wire.tensors import byte_view

log = logging.getLogger("tensorwire.client")


@dataclass(slots=True)
class DeltaStats:
    """What a client's delta reads moved (``AsyncClient.delta_stats``), summed over its reads."""

    reads: int = 0
    wire_bytes: int = 0  # answer data (deltas and full chunks) plus refetched chunks
    delta_chunks: int = 0  # chunks answered with a delta
    full_chunks: int = 0  # chunks answered in full (no base, or a delta would not be smaller)
    refetched: int = 0  # chunks whose delta did not check out, fetched again in full


async def read(
    run: Run, names: Sequence[str], out: Mapping[str, torch.Tensor], *, at: At, base: At, verify: bool,
    stats: DeltaStats,
) -> tuple[dict[str, torch.Tensor], str, int]:  # fmt: skip
    """Generation ``at`` of ``names`` into ``out`` (which holds generation ``base``), in place."""
    names = list(dict.fromkeys(names))
    targets = _targets(names, out)
    number, held = at_number(at), at_number(base)
    answer = await run(lambda t: _read(t, names, targets, at=number, base=held, stats=stats))
    if verify:
        manifest = await run(lambda t: as_generational(t, "verify").manifest(answer.prefix, answer.number))
        verify_read(manifest, targets, answer.digest)
    return targets, answer.prefix, answer.number


def _targets(names: list[str], out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    missing = [n for n in names if n not in out]
    if missing:
        raise InvalidTensor(f"a read with base= applies deltas to out=, which lacks {missing[:3]}")
    targets = {n: out[n] for n in names}
    for name, tensor in targets.items():
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise InvalidTensor(f"out[{name!r}] must be a contiguous CPU tensor for a delta read")
    return targets


async def _read(
    t: Transport, names: list[str], targets: dict[str, torch.Tensor], *, at: int, base: int, stats: DeltaStats
) -> dr.DeltaAnswer:
    scratch: list[memoryview] = []

    def sink(metas: list[TensorMeta]) -> list[memoryview]:
        if [m.name for m in metas] != names:
            raise ProtocolError("the server answered for other tensors than the ones asked for")
        for meta in metas:  # bounded before anything is allocated: the FULL form at most
            if meta.nbytes > dr.max_data_bytes(targets[meta.name].nbytes):
                raise ProtocolError(f"{meta.nbytes} delta bytes for {meta.name!r}, more than its full size")
        scratch[:] = [memoryview(bytearray(m.nbytes)) for m in metas]
        return scratch

    gens = as_generational(t, "a delta read")
    answer = await gens.get_delta_at(names, at, base, sink)
    stats.reads += 1  # once the answer is in, before anything is applied: `out` is untouched till then
    stats.wire_bytes += sum(v.nbytes for v in scratch)
    for entry, deltas in zip(answer.tensors, scratch, strict=True):
        await _apply(gens, answer, entry, deltas, out=targets[entry.meta.name], stats=stats)
    return answer


async def _apply(
    gens: Generational, answer: dr.DeltaAnswer, entry: dr.TensorDelta, deltas: memoryview, *,
    out: torch.Tensor, stats: DeltaStats,
) -> None:  # fmt: skip
    meta = entry.meta
    if out.dtype != meta.dtype or tuple(out.shape) != meta.shape:
        raise InvalidTensor(
            f"out[{meta.name!r}] is {out.dtype} {tuple(out.shape)}; generation {answer.number} has"
            f" {meta.dtype} {meta.shape}"
        )
    view, size, pos = byte_view(out), answer.chunk_size, 0
    for i, (length, expected) in enumerate(zip(entry.lengths, entry.checksums, strict=True)):
        chunk = view[i * size : (i + 1) * size]
        piece = deltas[pos : pos + length]
        pos += length
        if delta.kind_of(piece) == delta.Kind.FULL:
            stats.full_chunks += 1
        else:
            stats.delta_chunks += 1
        try:
            delta.apply_checked(chunk, piece, chunk, answer.checksum_kind, expected)
        except CorruptFrame:
            await _refetch(gens, answer, meta.name, chunk, offset=i * size, expected=expected)
            stats.refetched += 1
            stats.wire_bytes += chunk.nbytes


async def _refetch(
    gens: Generational, answer: dr.DeltaAnswer, name: str, chunk: memoryview, *, offset: int, expected: int
) -> None:
    """The chunk in full (a range read), checked against the new chunk's checksum."""
    log.warning(
        "the delta of bytes %d..%d of %r did not rebuild generation %d (out= did not hold the base);"
        " fetching the chunk in full", offset, offset + chunk.nbytes, name, answer.number,
    )  # fmt: skip
    await gens.get_range_at(name, answer.number, offset, chunk)
    if checksum(answer.checksum_kind, chunk) != expected:
        where = f"bytes {offset}..{offset + chunk.nbytes} of {name!r}"
        raise DigestMismatch(f"{where} differ from their checksum even read in full")
