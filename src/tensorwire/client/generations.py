"""The client side of generations (README, "Generations"; docs/protocol.md §14): what
``AsyncClient.publish``, reads with ``at=``, ``get_range``, ``manifest``, ``wait`` and ``lease``
do, as functions of the client's retrying call (``Run``), and the check behind ``verify=True``.

Names: ``publish(prefix, tensors)`` takes keys relative to the prefix and stores ``prefix/key``;
every read names full names (``prefix/key``), and the server finds the one prefix they lie under.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar

import torch

from tensorwire.client.batches import Landing, TensorBatch
from tensorwire.errors import DigestMismatch, InvalidTensor, UnsupportedTransport
from tensorwire.transport.base import (
    FrameChannel,
    Progress,
    Transport,
    as_generational,
    as_part_publisher,
    as_ranged_generations,
)
from tensorwire.types import Generation, GenerationManifest
from tensorwire.wire import generations as wg
from tensorwire.wire.frame import Opcode
from tensorwire.wire.names import validate_name
from tensorwire.wire.tensors import byte_view

T = TypeVar("T")
At = int | Literal["latest"]
DEFAULT_LEASE_SECONDS = 30.0


class Run(Protocol):
    """The client's retrying call (``AsyncClient._run``)."""

    def __call__(self, op: Callable[[Transport], Awaitable[T]], idempotent: bool = True) -> Awaitable[T]: ...


def at_number(at: At) -> int:
    """``at`` on the wire: a generation number (1, 2, ...), or 0 for ``"latest"``."""
    if at == "latest":
        return wg.LATEST
    if isinstance(at, bool) or not isinstance(at, int) or at < 1:
        raise InvalidTensor(f"at= takes a generation number (1, 2, ...) or 'latest', not {at!r}")
    return at


async def publish(
    run: Run, prefix: str, tensors: Mapping[str, torch.Tensor], progress: Progress | None
) -> Generation:
    """Every tensor of ``tensors`` as ``prefix/key``, visible at once as the prefix's next
    generation. Not retried once sent (a retry after a lost answer would publish twice)."""
    validate_name(prefix)
    if not tensors:
        raise InvalidTensor(f"a generation of {prefix!r} needs at least one tensor")
    batch = TensorBatch([(f"{prefix}/{key}", tensor) for key, tensor in tensors.items()])
    return await run(
        lambda t: as_generational(t, "publish").publish(prefix, batch, progress), idempotent=False
    )


async def publish_part(
    run: Run, prefix: str, tensors: Mapping[str, torch.Tensor], head: wg.PartHead, timeout: float
) -> Generation:
    """Part ``head.index`` of ``head.count`` of one generation of ``prefix`` (``tensors`` as
    ``prefix/key``), answered once every part is in (``PartPublisher``). Not retried once sent."""
    validate_name(prefix)
    if not tensors:
        raise InvalidTensor(f"a part of a generation of {prefix!r} needs at least one tensor")
    if not 0 < timeout < float("inf"):
        raise InvalidTensor(f"a multi-part publish needs a finite timeout, not {timeout}")
    if len(head.txn) != wg.TXN_BYTES or not 0 <= head.index < head.count:
        raise InvalidTensor(f"part {head.index} of {head.count} of a {len(head.txn)}-byte transaction")
    batch = TensorBatch([(f"{prefix}/{key}", tensor) for key, tensor in tensors.items()])

    async def op(t: Transport) -> Generation:
        publisher = as_part_publisher(t, "a multi-part publish")
        return await publisher.publish_part(
            prefix, batch, txn=head.txn, index=head.index, count=head.count, timeout=timeout
        )

    return await run(op, idempotent=False)


async def read(
    run: Run, names: Sequence[str], at: At, out: Mapping[str, torch.Tensor] | None, verify: bool
) -> tuple[dict[str, torch.Tensor], str, int]:
    """Tensors ``names`` (full names) of one generation; with ``verify``, checked against the
    generation's manifest and root digest (``verify_read``). Returns the tensors, the prefix and
    the generation number read."""
    names = list(dict.fromkeys(names))
    number = at_number(at)
    landing = Landing(names, dict(out or {}))

    async def op(t: Transport) -> tuple[dict[str, torch.Tensor], str, int, bytes]:
        landing.reset()
        prefix, read_at, digest = await as_generational(t, "a read at a generation").get_at(
            names, number, landing.sink
        )
        return landing.finish(), prefix, read_at, digest

    tensors, prefix, read_at, digest = await run(op)
    if verify:
        manifest = await run(lambda t: as_generational(t, "verify").manifest(prefix, read_at))
        verify_read(manifest, tensors, digest)
    return tensors, prefix, read_at


async def get_range(
    run: Run, name: str, at: At, offset: int, length: int, *, out: torch.Tensor | None
) -> torch.Tensor:
    """Bytes ``offset .. offset + length`` of ``name`` at one generation, as a uint8 tensor (``out``,
    any contiguous CPU tensor of ``length`` bytes, filled in place, when given)."""
    number = at_number(at)
    if offset < 0 or length < 0:
        raise InvalidTensor(f"bytes {offset}..{offset + length} are not a range")
    target = out if out is not None else torch.empty(length, dtype=torch.uint8)
    if not target.is_contiguous() or target.device.type != "cpu" or target.nbytes != length:
        raise InvalidTensor(f"out= must be a contiguous CPU tensor of {length} bytes")
    dest = byte_view(target)
    await run(lambda t: as_generational(t, "get_range").get_range_at(name, number, offset, dest))
    return target


async def drop(run: Run, prefix: str) -> int:
    """Every generation of ``prefix`` and the prefix itself (GEN_DROP), from the data directory too;
    how many generations there were. KeyNotFound if it has none; NotAuthorized while another
    connection holds a lease on one of them (this one's own leases end with the drop). Not retried
    once sent."""
    validate_name(prefix)

    async def op(t: Transport) -> int:
        as_generational(t, "drop_generations")  # UnsupportedTransport, naming the transport
        if not isinstance(t, FrameChannel):
            raise UnsupportedTransport(f"drop_generations is not served over {t.address.scheme}://")
        reader = await t.call(
            Opcode.GEN_DROP, wg.encode_prefix(prefix), what=f"drop the generations of {prefix!r}"
        )
        count = wg.decode_dropped(reader)
        reader.done()
        return count

    return await run(op, idempotent=False)


def verify_read(manifest: GenerationManifest, tensors: Mapping[str, torch.Tensor], digest: bytes) -> None:
    """DigestMismatch unless every tensor read has the dtype, shape and chunk checksums the
    manifest gives it, and the manifest's root digest is ``digest`` (what the read answered)."""
    kind, chunk = manifest.checksum_kind, manifest.chunk_size
    for name, tensor in tensors.items():
        try:
            entry = manifest.tensor(name)
        except KeyError:
            raise DigestMismatch(
                f"{name!r} is not in the manifest of the generation it was read at"
            ) from None
        meta = entry.meta
        if tensor.dtype != meta.dtype or tuple(tensor.shape) != meta.shape:
            raise DigestMismatch(
                f"{name!r} was read as {tensor.dtype} {tuple(tensor.shape)}, not as recorded"
            )
        sums = wg.chunk_checksums(byte_view(tensor.contiguous()), chunk, kind)
        for index, (got, want) in enumerate(zip(sums, entry.checksums, strict=True)):
            if got != want:
                raise DigestMismatch(f"chunk {index} of {name!r} differs from the generation's checksum")
    if wg.root_digest(manifest.tensors, chunk, kind) != digest or manifest.generation.digest != digest:
        gen = manifest.generation
        raise DigestMismatch(f"the root digest of generation {gen.number} of {gen.prefix!r} does not match")


class AsyncLease:
    """A lease on one generation (``await client.lease(prefix, number, seconds)``): the server
    keeps it, past ``--keep-generations``, until the lease runs out or is released. A context
    manager (``async with``) that releases on exit; ``renew`` extends it. The server grants at most
    its ``--max-lease-seconds`` (``seconds`` says what it granted) and drops the lease with the
    connection that took it."""

    def __init__(self, run: Run, prefix: str, number: int) -> None:
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            # "latest" would move under the lease: the server refuses it too (docs/protocol.md §14)
            raise InvalidTensor(
                f"a lease names a generation by its number (1, 2, ...), not {number!r}: read the newest"
                " one's number first (client.manifest(prefix).generation.number)"
            )
        self._run = run
        self.prefix = prefix
        self.number = number
        self.seconds = 0.0  # granted by the last renew
        self.oldest = 0  # the oldest generation the prefix kept at the last renew

    async def renew(self, seconds: float = DEFAULT_LEASE_SECONDS) -> float:
        """Keep the generation ``seconds`` more from now (GenerationRetired if it is gone)."""
        if seconds <= 0:
            raise InvalidTensor(f"a lease lasts a positive number of seconds, not {seconds}")
        self.seconds, self.oldest = await self._lease(seconds)
        return self.seconds

    async def release(self) -> None:
        self.seconds, self.oldest = await self._lease(0.0)

    def _lease(self, seconds: float) -> Awaitable[tuple[float, int]]:
        prefix, number = self.prefix, self.number
        return self._run(lambda t: as_ranged_generations(t, "lease").lease(prefix, number, seconds))

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


class Lease:
    """``AsyncLease`` for the blocking client: the same methods, run on the client's loop."""

    def __init__(self, lease: AsyncLease, call: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self._lease = lease
        self._call = call

    @property
    def prefix(self) -> str:
        return self._lease.prefix

    @property
    def number(self) -> int:
        return self._lease.number

    @property
    def seconds(self) -> float:
        return self._lease.seconds

    @property
    def oldest(self) -> int:
        return self._lease.oldest

    def renew(self, seconds: float = DEFAULT_LEASE_SECONDS) -> float:
        return float(self._call(self._lease.renew(seconds)))

    def release(self) -> None:
        self._call(self._lease.release())

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
