"""Where pushed gradients land on a parameter server, and the sync pushes that wait for their step.

A push carries one record per shard of the server (``shards_for`` checks them against the job);
its data lands in a set of buffers the size of the shards (``take``), raw or as a codec's payloads
decoded on the optimizer's thread (``receive``). A sync job's pushes wait in ``pending`` (by clock,
then by worker) until every live worker's is in; then the step sums them and the buffers go back
to ``free`` for the next push (fresh pages cost more than reusing them). Every buffer and payload
is counted in the budget (ps/budget.py) before it is allocated; ``make_room`` lets go of free
buffers when something else needs the room.

The pending pushes travel with the job: a backup's state transfer carries them, and loading a
job (a checkpoint, a state transfer) replaces them (ps/server/state.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tensorwire.compression.codecs import Codec, decode_all, payload_total
from tensorwire.errors import InvalidTensor, ProtocolError
from tensorwire.ps.budget import Budget
from tensorwire.ps.job import HeldShard, Job, check_records
from tensorwire.server.core import Request
from tensorwire.types import TensorMeta
from tensorwire.wire.tensors import byte_view

Grads = list[torch.Tensor | None]  # one per shard of the server; None: no gradient for it


@dataclass(eq=False)
class Pending:
    """The gradients pushed for one clock of a sync job, by worker: (its buffers, its gradients)."""

    grads: dict[int, tuple[Grads, Grads]] = field(default_factory=dict)


class Gradients:
    """The buffers pushes land in and the pushes waiting for a sync step (see the module doc)."""

    def __init__(self, job: Job, budget: Budget) -> None:
        self._job = job
        self._budget = budget
        self.pending: dict[int, Pending] = {}
        self.free: list[Grads] = []  # gradient buffers for reuse (fresh pages are slow)
        budget.reclaimer(self, self._let_go)  # another job may need the room they take

    def shards_for(
        self, metas: Sequence[TensorMeta], data_len: int, codec: Codec | None = None
    ) -> tuple[list[HeldShard], list[bool]]:
        """A push carries one record for each shard here, in the shards' order: its gradient, or
        an empty one (``shape (0,)``) where the worker has no gradient (a parameter it did not use,
        which torch.optim would skip). Returns the shards and which of them have a gradient.
        With a codec the records describe the gradients as decoded, and the data holds payloads."""
        check_records(metas, data_len if codec is None else None)
        if codec is not None and payload_total(codec, (m.numel for m in metas if m.nbytes)) != data_len:
            raise InvalidTensor(f"the {codec.name} payloads of the records do not add up to the frame's data")
        shards = list(self._job.shards.values())
        if [m.name for m in metas] != [s.key for s in shards]:
            raise ProtocolError("a push must carry a record for every shard of this server, in its order")
        present = []
        for meta, shard in zip(metas, shards, strict=True):
            if meta.dtype != shard.param.dtype:
                raise InvalidTensor(
                    f"gradient {meta.name!r} is {meta.dtype}; the shard is {shard.param.dtype}"
                )
            if meta.nbytes not in (0, shard.meta.nbytes):
                raise InvalidTensor(
                    f"gradient {meta.name!r} has {meta.nbytes} bytes; the shard {shard.meta.nbytes}"
                )
            present.append(meta.nbytes == shard.meta.nbytes)
        return shards, present

    def take(self, shards: Sequence[HeldShard]) -> Grads:
        """A set of gradient buffers for a push: a free one of the current shards, or a new one
        counted against the capacity first (CapacityExceeded, nothing changed, if it cannot be)."""
        like = [(s.param.numel(), s.param.dtype) for s in shards]
        while self.free:
            buffers = self.free.pop()
            if [(b.numel(), b.dtype) for b in buffers if b is not None] == like:
                return buffers
            self._budget.release("gradients", nbytes(buffers))  # of shards since replaced
        size = sum(s.meta.nbytes for s in shards)
        self.make_room(size)
        self._budget.reserve("gradients", size, "a push's gradient buffers")
        fresh: Grads = [torch.empty_like(s.param.data) for s in shards]
        return fresh

    def make_room(self, size: int) -> None:
        """Let go of free gradient buffers (kept only to save page faults), this job's first, then
        the other jobs', while ``size`` more bytes do not fit in the server's capacity."""
        self._let_go(size)
        self._budget.make_room(size)

    def _let_go(self, size: int) -> None:
        while self.free and not self._budget.fits(size):
            self._budget.release("gradients", nbytes(self.free.pop()))

    def close(self) -> None:
        """The job ended: drop every buffer, and stop offering room."""
        self.replace({})
        self._budget.reclaimer(self, None)

    async def receive(self, request: Request, codec: Codec | None, grads: Grads) -> list[memoryview]:
        """Receive a push's data into ``grads``: raw bytes straight in, or a codec's payloads,
        decoded (once, on the optimizer's thread) before anything is replicated or applied, so a
        payload that does not decode changes nothing. Returns the data as received."""
        present = [g for g in grads if g is not None]
        if codec is None:
            data = [byte_view(g) for g in present]
            await request.receive(data)
            return data
        # Sizes from this server's own shards (``shards_for`` checked the records against them),
        # counted before they are allocated; the decode runs on the optimizer's thread.
        sizes = [codec.payload_bytes(g.numel()) for g in present]
        self._budget.reserve("payloads", sum(sizes), f"the {codec.name} payloads of a push")
        try:
            payloads = [torch.empty(n, dtype=torch.uint8) for n in sizes]
            data = [byte_view(p) for p in payloads]
            await request.receive(data)
            await self._job.run(decode_all, codec, payloads, present)
        finally:
            # Decoded: what is left of them is the replication that follows (one push per worker).
            self._budget.release("payloads", sum(sizes))
        return data

    def replace(self, pending: dict[int, dict[int, Grads]]) -> None:
        """Drop every buffer (a job is loaded: its shards are new) and hold ``pending`` instead,
        the gradients of a sync step not taken yet on the primary (by clock, by worker)."""
        dropped = [b for b, _ in (g for p in self.pending.values() for g in p.grads.values())] + self.free
        self._budget.release("gradients", sum(map(nbytes, dropped)))
        self.pending.clear()
        self.free.clear()
        shards = list(self._job.shards.values())
        for clock, by_worker in pending.items():
            for worker, grads in by_worker.items():
                buffers: Grads = [g if g is not None else torch.empty_like(s.param.data)
                                  for g, s in zip(grads, shards, strict=True)]  # fmt: skip
                self.pending.setdefault(clock, Pending()).grads[worker] = (buffers, grads)
                self._budget.add("gradients", nbytes(buffers))  # the primary's, as it counted them


def nbytes(tensors: Sequence[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
