"""The server's side of a delta read without a network (server/delta_answers.py): deltas only where
smaller, FULL chunks sent from the kept bytes, and the encoded bytes one answer holds bounded by its
budget (past it, every chunk goes FULL)."""

from __future__ import annotations

import torch

from tensorwire.server import delta_answers
from tensorwire.store import TensorStore
from tensorwire.store.generations import Generations
from tensorwire.types import TensorMeta
from tensorwire.wire import delta
from tensorwire.wire import generations as wg

ELEMS = 3 * wg.CHUNK_BYTES // 4 // 2  # fp32: one and a half chunks


def publish(gens: Generations, values: torch.Tensor) -> int:
    metas = [TensorMeta("m/w", torch.float32, (ELEMS,), 4 * ELEMS)]
    res = gens.store.reserve(metas)
    res.buffers[0].cast("B")[:] = values.numpy().tobytes()
    return gens.publish("m", res, [wg.chunk_checksums(res.buffers[0])]).number


def test_deltas_within_the_budget_and_full_chunks_past_it() -> None:
    gens = Generations(TensorStore(capacity=64 << 20))
    old = torch.randn(ELEMS, generator=torch.Generator().manual_seed(0))
    new = old.clone()
    new[::100] += 1.0
    publish(gens, old)
    publish(gens, new)
    base, kept = gens.pin("m", 1), gens.pin("m", 2)
    pairs = [kept.tensors["m/w"]]
    answer, data = delta_answers.build(kept, base, pairs)
    assert answer.base == 1 and [d[0] for d in data] == [delta.Kind.SPARSE] * 2
    assert sum(answer.tensors[0].lengths) == sum(d.nbytes for d in data) < 0.05 * 4 * ELEMS
    assert answer.tensors[0].checksums == kept.sums[0].checksums
    # a budget one chunk's delta uses up: the second chunk goes FULL, from the kept bytes
    answer, data = delta_answers.build(kept, base, pairs, budget=1)
    assert [d.nbytes for d in data[1:]] == [1, 4 * ELEMS - wg.CHUNK_BYTES]
    assert data[2].obj is pairs[0][1].obj  # no copy: a view of the generation's own buffer
    # no base: every chunk FULL
    answer, data = delta_answers.build(kept, None, pairs)
    assert answer.base == 0
    assert answer.tensors[0].lengths == (1 + wg.CHUNK_BYTES, 1 + 4 * ELEMS - wg.CHUNK_BYTES)
    gens.unpin(base)
    gens.unpin(kept)
