"""Sharded state (DTensor / FSDP): put from N ranks, read on M ranks, only the overlap moved.

``put_state_dict(client, prefix, state_dict)`` is called on every rank of a process group. The
ranks gather their layouts (``layout_of``: per parameter its dtype, global shape, mesh, placements
and the box this rank holds) and refuse, every one of them, before a byte moves, if they disagree
or their boxes do not tile a parameter. Each rank then sends the boxes it stores (a box held by
several ranks, Replicate, by the lowest of them only) as one part of a multi-part publish
(GEN_PUBLISH_PART, docs/protocol.md §14.8); rank 0's part also carries the layout document
(``<prefix>/_layout``). The server makes the whole state visible as one generation once every
rank's part is in, or nothing of it (a rank that dies midway aborts it: the previous generation
stays readable), and every rank gets the same answer.

``load_state_dict(client, prefix, into=state_dict)`` reads on any world size and placements: it
holds one generation (``Client.read_generation``), checks its layout document like any peer input
and every tensor of ``into`` against it (dtype, global shape; the readers' boxes must tile it too),
raising ``LayoutMismatch`` naming the parameter and both layouts before any byte moves, then reads
exactly the byte runs of the stored shards that overlap this rank's shard, many in flight, straight
into the local tensor (a contiguous CPU one: no extra copy).

Over every transport that can do what this asks of it (``PartPublisher`` for the put; for the
read ``RangedGenerations`` or ``GenerationViews``): tcp://, tls://, memory://, shm://, grpc://,
grpcs:// (the PublishPart and GetRanges calls, docs/protocol.md §14.9).

Values are plain tensors (whole, the same on every rank: stored once) or DTensors with Shard(d)
and Replicate placements on meshes of any dimension; Partial (and strided) placements are refused.
Without torch.distributed initialised the world is one rank.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from tensorwire._deprecated import renamed
from tensorwire.client.blocking import Client
from tensorwire.client.ranges import GenerationRead, RangeRead
from tensorwire.errors import KeyNotFound, LayoutMismatch, TensorwireError
from tensorwire.sharded.layout import (
    LAYOUT_KEY,
    MAX_DOCUMENT_BYTES,
    Box,
    ShardLayout,
    Stored,
    decode_document,
    encode_document,
    merge,
    overlap_runs,
)
from tensorwire.types import Generation, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire.names import validate_name
from tensorwire.wire.tensors import byte_view

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["get_state_dict", "layout_of", "load_state_dict", "put_state_dict"]

_RESERVED = (LAYOUT_KEY, "_rank")  # keys under the prefix that are not parameters


def layout_of(
    state_dict: Mapping[str, torch.Tensor], *, group: ProcessGroup | None = None
) -> dict[str, ShardLayout]:
    """The layout ``state_dict`` describes on this rank (of ``group``): per parameter its dtype,
    global shape, mesh shape and placements, and the box this rank holds (a plain tensor: the
    whole). LayoutMismatch for a Partial or strided placement, or a reserved name."""
    rank = _rank_world(group)[0]
    return {name: _layout(name, tensor, rank) for name, tensor in state_dict.items()}


def put_state_dict(
    client: Client,
    prefix: str,
    state_dict: Mapping[str, torch.Tensor],
    *,
    group: ProcessGroup | None = None,
    timeout: float = 60.0,
) -> Generation:
    """Put this rank's shards of ``state_dict`` under ``prefix``; called on every rank of
    ``group`` (default: the default group). Returns the committed generation on every rank, or
    raises on every rank (module docstring)."""
    rank, world = _rank_world(group)
    layouts, txn = _agreed(state_dict, group, rank, world, with_txn=True)
    part: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        for stored in layouts[name].boxes:
            if stored.rank == rank:
                part[stored.tensor] = _local(tensor).contiguous()
    if rank == 0:
        part[LAYOUT_KEY] = torch.frombuffer(bytearray(encode_document(layouts)), dtype=torch.uint8)
    if not part:  # every part carries a tensor: an empty one for a rank that stores no box
        part[f"_rank/{rank}"] = torch.empty(0, dtype=torch.uint8)
    return client.publish_part(prefix, part, txn=txn, index=rank, count=world, timeout=timeout)


def load_state_dict(
    client: Client,
    prefix: str,
    into: Mapping[str, torch.Tensor],
    *,
    at: int | Literal["latest"] = "latest",
    group: ProcessGroup | None = None,
) -> Generation:
    """Fill every tensor of ``into`` (plain tensors, or DTensors: their local shard) in place from
    generation ``at`` of ``prefix``; returns the generation read (module docstring). Named for
    what it does, as torch's ``Module.load_state_dict`` and DCP's ``load`` fill what they are given
    in place (torch's ``get_state_dict`` returns state dicts instead)."""
    rank, world = _rank_world(group)
    _agreed(into, group, rank, world, with_txn=False)  # the readers' boxes tile every parameter
    wanted = layout_of(into, group=group)
    with client.read_generation(prefix, at) as read:
        stored = _stored_layouts(read, prefix)
        plans = [_plan(read, prefix, stored, wanted[name], tensor) for name, tensor in into.items()]
        read.read([r for plan in plans for r in plan.reads])  # the only bytes of shards that move
        for plan in plans:
            plan.land()
        return read.generation


# The name before issue 33, kept for one release (it warns): torch's get_state_dict returns dicts.
get_state_dict = renamed("tensorwire.sharded.get_state_dict", load_state_dict)


# -- layouts ------------------------------------------------------------------------------------
def _layout(name: str, tensor: torch.Tensor, rank: int) -> ShardLayout:
    validate_name(name)  # here, so that every rank hears of it before any part is sent
    if name.split("/", 1)[0] in _RESERVED:
        raise LayoutMismatch(f"{name!r}: a parameter may not be named {name.split('/', 1)[0]!r} (reserved)")
    dtensor = _as_dtensor(tensor)
    if dtensor is None:
        box = Box((0,) * tensor.dim(), tuple(tensor.shape))
        return ShardLayout(
            name, tensor.dtype, tuple(tensor.shape), boxes=(Stored(box, rank, f"{name}/{box.key()}"),)
        )
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = []
    for p in dtensor.placements:
        if type(p) is Shard:
            placements.append(f"S({p.dim})")
        elif type(p) is Replicate:
            placements.append("R")
        else:
            raise LayoutMismatch(f"{name!r}: placement {p} is not supported (only Shard(dim) and Replicate)")
    shape = tuple(dtensor.shape)
    local_shape, offsets = compute_local_shape_and_global_offset(
        shape, dtensor.device_mesh, dtensor.placements
    )
    box = Box(tuple(int(o) for o in offsets), tuple(int(s) for s in local_shape))
    if tuple(dtensor.to_local().shape) != box.sizes:
        raise LayoutMismatch(
            f"{name!r}: its local shard is {list(dtensor.to_local().shape)}, not {list(box.sizes)}"
        )
    mesh = tuple(int(n) for n in dtensor.device_mesh.shape)
    return ShardLayout(
        name, dtensor.dtype, shape, mesh, tuple(placements), (Stored(box, rank, f"{name}/{box.key()}"),)
    )


def _as_dtensor(tensor: torch.Tensor) -> Any:
    """``tensor`` if it is a DTensor, else None (torch.distributed may be absent)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return tensor if isinstance(tensor, DTensor) else None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    dtensor = _as_dtensor(tensor)
    local = dtensor.to_local() if dtensor is not None else tensor
    return local.detach()


def _rank_world(group: ProcessGroup | None) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _agreed(
    state_dict: Mapping[str, torch.Tensor],
    group: ProcessGroup | None,
    rank: int,
    world: int,
    *,
    with_txn: bool,
) -> tuple[dict[str, ShardLayout], bytes]:
    """Every rank's layout gathered (with rank 0's transaction id) and merged, the same on every
    rank: a rank's own refusal is raised on all of them, so none is left waiting in a collective."""
    try:
        mine: dict[str, ShardLayout] | None = layout_of(state_dict, group=group)
        problem = ""
    except TensorwireError as exc:
        mine, problem = None, f"rank {rank}: {exc}"
    txn = os.urandom(wg.TXN_BYTES) if with_txn and rank == 0 else b""
    gathered = _all_gather((mine, problem, txn), group, world)
    problems = [p for _, p, _ in gathered if p]
    if problems:
        raise LayoutMismatch("; ".join(problems))
    return merge([m for m, _, _ in gathered if m is not None]), gathered[0][2]


def _all_gather(value: Any, group: ProcessGroup | None, world: int) -> list[Any]:
    """``value`` of every rank, by rank. Between the job's own ranks, so pickling is theirs."""
    if world == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * world
    dist.all_gather_object(out, value, group=group)
    return out


# -- reads --------------------------------------------------------------------------------------
def _stored_layouts(read: GenerationRead, prefix: str) -> dict[str, ShardLayout]:
    """The generation's layout document, checked like any peer input: decodes (each parameter's
    boxes tile it) and every stored box's tensor is in the generation with its box's dtype, shape
    and size."""
    meta = read.metas.get(f"{prefix}/{LAYOUT_KEY}")
    if meta is None:
        raise KeyNotFound(
            f"generation {read.generation.number} of {prefix!r} holds no sharded state ({LAYOUT_KEY})"
        )
    if meta.dtype != torch.uint8 or len(meta.shape) != 1 or meta.nbytes > MAX_DOCUMENT_BYTES:
        raise LayoutMismatch(
            f"{prefix}/{LAYOUT_KEY} is {meta.dtype} {list(meta.shape)}, not a layout document"
        )
    data = torch.empty(meta.nbytes, dtype=torch.uint8)
    read.read([RangeRead(meta.name, 0, byte_view(data))])
    layouts = decode_document(data.numpy().tobytes())
    for layout in layouts.values():
        for stored in layout.boxes:
            _check_stored(read.metas.get(f"{prefix}/{stored.tensor}"), layout, stored)
    return layouts


def _check_stored(meta: TensorMeta | None, layout: ShardLayout, stored: Stored) -> None:
    name = layout.name
    if meta is None:
        raise LayoutMismatch(
            f"{name!r}: box {stored.box} names {stored.tensor!r}, which the generation lacks"
        )
    if meta.dtype != layout.dtype or meta.shape != stored.box.sizes:
        raise LayoutMismatch(
            f"{name!r}: box {stored.box} is stored as {meta.dtype} {list(meta.shape)}, not as its layout says"
        )
    if meta.nbytes != stored.box.numel * layout.dtype.itemsize:
        raise LayoutMismatch(f"{name!r}: box {stored.box} is stored in {meta.nbytes} bytes, not its size")


@dataclass
class _Plan:
    """What one tensor of ``into`` reads: its runs, into ``buffer`` (the local shard itself when
    that is a contiguous CPU tensor, else a copy landed at the end)."""

    target: torch.Tensor
    buffer: torch.Tensor
    reads: list[RangeRead] = field(default_factory=list)

    def land(self) -> None:
        if self.buffer is not self.target:
            self.target.copy_(self.buffer.view(self.target.shape))


def _plan(
    read: GenerationRead,
    prefix: str,
    stored: Mapping[str, ShardLayout],
    wanted: ShardLayout,
    tensor: torch.Tensor,
) -> _Plan:
    name = wanted.name
    have = stored.get(name)
    if have is None:
        raise LayoutMismatch(f"{name!r} is not in generation {read.generation.number} of {prefix!r}")
    if have.dtype != wanted.dtype or have.shape != wanted.shape:
        raise LayoutMismatch(f"{name!r} is stored as {have.describe()}, but read into {wanted.describe()}")
    target = _local(tensor)
    direct = target.device.type == "cpu" and target.is_contiguous()
    buffer = target if direct else torch.empty(tuple(target.shape), dtype=target.dtype)
    plan = _Plan(target, buffer)
    dest = byte_view(buffer)
    box, itemsize = wanted.boxes[0].box, wanted.dtype.itemsize
    for piece in have.boxes:
        full = f"{prefix}/{piece.tensor}"
        for src, dst, length in overlap_runs(piece.box, box, itemsize):
            plan.reads.append(RangeRead(full, src, dest[dst : dst + length]))
    return plan
