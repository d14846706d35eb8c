"""Delta reads end to end (README, "Deltas"; docs/protocol.md §14): a reader holding generation b in
its ``out`` tensors reads generation g with ``base=b`` and receives only what changed, applied in
place, bit-exact; a retired base costs the full read, a tampered ``out`` a refetched chunk."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest
import torch

import tensorwire
import tensorwire._aio
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions
from tensorwire.store.generations import GenerationConfig

FP32 = 2_500_000  # 10 MB: three 4 MiB chunks
BF16 = 1_000_000  # 2 MB: one chunk
NAMES = ["m/w", "m/h"]


def first() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(FP32, generator=g), "h": torch.randn(BF16, generator=g).bfloat16()}


def changed(tensors: dict[str, torch.Tensor], seed: int, share: float = 0.01) -> dict[str, torch.Tensor]:
    """A copy with ``share`` of each tensor's elements set to new values, at random positions."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, t in tensors.items():
        new = t.clone()
        idx = torch.randperm(new.numel(), generator=g)[: int(new.numel() * share)]
        new[idx] = torch.randn(idx.numel(), generator=g).to(new.dtype)
        out[key] = new
    return out


def full_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


def same(read: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(read[f"m/{k}"].view(torch.uint8), v.view(torch.uint8)) for k, v in want.items())


def sent(srv: ServerThread) -> int:
    return sum(row.sent for (op, _), row in srv.server.counts.rows.items() if op == "gen_get_delta")


@pytest.fixture
def server() -> Iterator[ServerThread]:
    with ServerThread(options=ServerOptions(generations=GenerationConfig(keep=3))) as srv:
        yield srv


@contextlib.contextmanager
def two_generations(
    server: ServerThread,
) -> Iterator[tuple[tensorwire.Client, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """A client of ``server`` after publishing generations 1 and 2 (1% changed), the tensors it
    read at generation 1, and generation 2 as published."""
    g1 = first()
    g2 = changed(g1, 2)
    with tensorwire.connect(server.url) as c:
        c.publish("m", g1)
        c.publish("m", g2)
        yield c, c.get_many(NAMES, at=1), g2


def test_a_delta_read_is_bit_exact_and_moves_under_5_percent(server: ServerThread) -> None:
    with two_generations(server) as (c, out, g2):
        held = dict(out)
        read = c.get_many(NAMES, at=2, base=1, out=out, verify=True)
        assert same(read, g2)
        assert all(read[n] is held[n] for n in NAMES)  # in place
        stats = c.delta_stats
        assert stats.refetched == 0 and stats.full_chunks == 0 and stats.delta_chunks == 4
        assert stats.wire_bytes == sent(server) <= 0.05 * full_bytes(g2)
        # get() too, for one name
        one = c.get_many(["m/h"], at=1)["m/h"]
        assert torch.equal(c.get("m/h", one, at=2, base=1).view(torch.uint8), g2["h"].view(torch.uint8))


def test_a_retired_or_unknown_base_gets_full_chunks(server: ServerThread) -> None:
    gens = [first()]
    with tensorwire.connect(server.url) as c:
        c.publish("m", gens[0])
        out = c.get_many(NAMES, at=1)
        for g in range(2, 5):  # keep=3: generation 1 is retired by the 4th
            gens.append(changed(gens[-1], g))
            c.publish("m", gens[-1])
        for base in (1, 99):
            before = c.delta_stats.full_chunks
            read = c.get_many(NAMES, at=4, base=base, out=out)
            assert same(read, gens[3]) and c.delta_stats.full_chunks - before == 4
        assert c.delta_stats.delta_chunks == 0 and c.delta_stats.refetched == 0


def test_an_out_that_does_not_hold_the_base_is_refetched(server: ServerThread) -> None:
    with two_generations(server) as (c, out, g2):
        out["m/w"][FP32 // 2] += 1.0  # the middle chunk no longer holds generation 1
        read = c.get_many(NAMES, at=2, base=1, out=out)
        assert same(read, g2)
        assert c.delta_stats.refetched == 1 and c.delta_stats.delta_chunks == 4


def test_readers_at_different_generations_each_get_their_own_delta(server: ServerThread) -> None:
    g1 = first()
    g2 = changed(g1, 2)
    g3 = changed(g2, 3)

    async def reader(held: int, ready: asyncio.Event, published: asyncio.Event) -> tuple[bool, int, int]:
        async with await tensorwire.aconnect(server.url) as c:
            out = await c.get_many(NAMES, at=held)
            ready.set()
            await published.wait()
            read = await c.get_many(NAMES, at=3, base=held, out=out)
            return same(read, g3), c.delta_stats.delta_chunks, c.delta_stats.refetched

    async def scene() -> list[tuple[bool, int, int]]:
        events = [asyncio.Event() for _ in range(3)]
        async with await tensorwire.aconnect(server.url) as pub:
            await pub.publish("m", g1)
            await pub.publish("m", g2)
            readers = [asyncio.create_task(reader(held, events[held - 1], events[2])) for held in (1, 2)]
            await asyncio.wait_for(asyncio.gather(events[0].wait(), events[1].wait()), 30)
            await pub.publish("m", g3)
            events[2].set()
            return list(await asyncio.wait_for(asyncio.gather(*readers), 30))

    assert tensorwire._aio.run(scene()) == [(True, 4, 0), (True, 4, 0)]
    assert sent(server) <= 2 * 0.05 * full_bytes(g1)
