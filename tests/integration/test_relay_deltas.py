"""Subscribers that hold a generation read the next one as a delta from the origin (README, "Publish
once, read by many"): readers with nothing go through the relay, readers at different generations
each get their own delta, a retired base or a failed delta read costs the whole generation through
the relay, and tensors changed by the user are caught chunk by chunk. Bit-exact every time."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import tensorwire
from tensorwire.broadcast import subscriber as subscriber_module
from tensorwire.errors import ConnectError, CorruptFrame
from tensorwire.server import ServerThread
from tensorwire.testing.process import run_threads
from tensorwire.testing.relay import blank_like, model_bytes, model_tensors, origin, same_bytes, subscribers

PREFIX = "policy"


def changed(tensors: dict[str, torch.Tensor], seed: int, share: float = 0.01) -> dict[str, torch.Tensor]:
    """A copy with ``share`` of each tensor's elements given new values, at random positions."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, tensor in tensors.items():
        new = tensor.clone().reshape(-1)
        idx = torch.randperm(new.numel(), generator=gen)[: int(new.numel() * share)]
        if new.dtype == torch.bool:
            new[idx] = ~new[idx]
        elif new.dtype.is_floating_point:
            new[idx] = torch.randn(idx.numel(), generator=gen).to(new.dtype)
        else:
            new[idx] += 1
        out[key] = new.reshape(tensor.shape)
    return out


@contextmanager
def published(keep: int = 2) -> Iterator[tuple[ServerThread, tensorwire.Client]]:
    """An origin relaying its published generations, and a trainer's client of it."""
    with origin(generations=True, keep=keep) as (srv, _), tensorwire.connect(srv.url) as trainer:
        yield srv, trainer


def origin_delta_bytes(srv: ServerThread) -> int:
    """Data bytes the origin sent answering delta reads."""
    return sum(row.sent for (op, _), row in srv.server.counts.rows.items() if op == "gen_get_delta")


def last(sub: tensorwire.Subscriber) -> Any:
    return sub.updates[-1]


def served(sub: tensorwire.Subscriber, generation: int) -> int:
    gens = [g["served_bytes"] for g in sub.stats()["generations"] if g["generation"] == generation]
    return sum(gens)


def test_three_readers_take_g1_through_the_relay_and_g2_as_deltas() -> None:
    g1 = model_tensors(1)
    g2 = changed(g1, 2)
    with published() as (srv, trainer):
        n1 = trainer.publish(PREFIX, g1).number
        targets = [blank_like(g1) for _ in range(3)]
        with subscribers(srv.url, PREFIX, targets) as subs:
            run_threads(lambda i: subs[i].update(timeout=30), 3, timeout=60)
            assert all(same_bytes(g1, t) for t in targets)
            assert [last(s).way for s in subs] == ["relay"] * 3
            assert served(subs[0], n1) <= 1.1 * model_bytes(g1)  # the origin sent g1 about once
            n2 = trainer.publish(PREFIX, g2).number
            got = [0] * 3

            def read(i: int) -> None:
                got[i] = subs[i].update(timeout=30)

            run_threads(read, 3, timeout=60)
            assert got == [n2] * 3 and all(same_bytes(g2, t) for t in targets)
            for sub in subs:
                record = last(sub)
                assert (record.way, record.base, record.generation, record.fallback) == ("delta", n1, n2, "")
                assert 0 < record.bytes <= 0.05 * model_bytes(g1), record
                assert sub.delta_stats.refetched == 0 and sub.delta_stats.full_chunks == 0
            stats = subs[0].stats()
            assert stats["updates"][-1]["way"] == "delta" and stats["deltas"]["reads"] == 1
            assert served(subs[0], n2) == 0  # nobody needed g2 through the relay
            # The origin's link carried the three deltas (counted once each answer is sent) and no more.
            received = sum(last(sub).bytes for sub in subs)
            deadline = time.monotonic() + 10
            while origin_delta_bytes(srv) < received and time.monotonic() < deadline:
                time.sleep(0.01)
            assert origin_delta_bytes(srv) == received <= 3 * 0.05 * model_bytes(g1)
            assert subs[0].update(timeout=30) == n2 and last(subs[0]).way == "current"


def test_readers_at_g1_and_at_g2_each_get_their_own_delta_to_g3() -> None:
    g1 = model_tensors(1)
    g2 = changed(g1, 2)
    g3 = changed(g2, 3)
    with published(keep=3) as (srv, trainer):
        n1 = trainer.publish(PREFIX, g1).number
        targets = [blank_like(g1) for _ in range(2)]
        with subscribers(srv.url, PREFIX, targets) as (old, new):
            old.update(timeout=30)
            n2 = trainer.publish(PREFIX, g2).number
            new.update(timeout=30)  # holds nothing: the whole of g2, through the relay
            assert last(new).way == "relay" and same_bytes(g2, targets[1])
            n3 = trainer.publish(PREFIX, g3).number
            assert old.update(timeout=30) == new.update(timeout=30) == n3
            assert all(same_bytes(g3, t) for t in targets)
            assert [(last(s).way, last(s).base) for s in (old, new)] == [("delta", n1), ("delta", n2)]
            assert all(last(s).bytes <= 0.05 * model_bytes(g1) for s in (old, new))
            # The g1 -> g3 delta holds two steps' changes; g2 -> g3 one.
            assert last(new).bytes < last(old).bytes


def test_a_reader_whose_base_was_retired_gets_the_whole_generation_through_the_relay() -> None:
    gens = [model_tensors(1)]
    with published(keep=2) as (srv, trainer):
        n1 = trainer.publish(PREFIX, gens[0]).number
        target = blank_like(gens[0])
        with subscribers(srv.url, PREFIX, [target]) as (sub,):
            sub.update(timeout=30)
            for seed in (2, 3):  # keep=2: the third retires g1
                gens.append(changed(gens[-1], seed))
                n3 = trainer.publish(PREFIX, gens[-1]).number
            assert sub.update(timeout=30) == n3 and same_bytes(gens[-1], target)
            record = last(sub)
            assert (record.way, record.base) == ("relay", n1) and "GenerationRetired" in record.fallback
            assert record.bytes == model_bytes(gens[0]) and sub.delta_stats.reads == 0


def test_tensors_changed_by_the_user_are_refetched_chunk_by_chunk() -> None:
    """The documented semantics: ``update()`` brings the generation, bit for bit, whatever was
    written into ``into`` since; a chunk that no longer holds the base fails its delta's checksum
    and is fetched again in full, the others take their deltas."""
    g1 = model_tensors(1)
    g2 = changed(g1, 2)
    with published() as (srv, trainer):
        trainer.publish(PREFIX, g1)
        target = blank_like(g1)
        with subscribers(srv.url, PREFIX, [target]) as (sub,):
            sub.update(timeout=30)
            target["fc2.weight"][0, 0] += 1.0  # the user's own edits
            target["mask"].logical_not_()
            n2 = trainer.publish(PREFIX, g2).number
            assert sub.update(timeout=30) == n2 and same_bytes(g2, target)
            assert last(sub).way == "delta" and sub.delta_stats.refetched == 2
            assert last(sub).bytes < 0.5 * model_bytes(g1)


def test_a_delta_read_that_fails_half_way_falls_back_to_the_relay(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    g1 = model_tensors(1)
    g2 = changed(g1, 2)
    real = subscriber_module.delta_reads.read

    async def broken(run: Any, names: Any, out: Any, *, stats: Any, **kw: Any) -> Any:
        stats.reads += 1  # the answer is in; applying it fails half-way
        out[names[0]].view(-1)[:4].view(torch.uint8).fill_(0xFF)
        raise CorruptFrame("the connection broke after one chunk")

    with published() as (srv, trainer):
        trainer.publish(PREFIX, g1)
        target = blank_like(g1)
        with subscribers(srv.url, PREFIX, [target]) as (sub,):
            sub.update(timeout=30)
            n2 = trainer.publish(PREFIX, g2).number
            monkeypatch.setattr(subscriber_module.delta_reads, "read", broken)
            with caplog.at_level(logging.WARNING, "tensorwire.broadcast"):
                assert sub.update(timeout=30) == n2
            assert same_bytes(g2, target)
            record = last(sub)
            assert (record.way, record.base) == ("relay", 0) and "CorruptFrame" in record.fallback
            assert record.bytes == model_bytes(g1)
            assert any("falls back to the relay" in r.getMessage() for r in caplog.records)
            monkeypatch.setattr(subscriber_module.delta_reads, "read", real)
            g3 = changed(g2, 3)
            trainer.publish(PREFIX, g3)
            sub.update(timeout=30)  # holds g2 again: a delta
            assert last(sub).way == "delta" and same_bytes(g3, target)


def test_deltas_false_always_reads_through_the_relay() -> None:
    g1 = model_tensors(1)
    with published() as (srv, trainer):
        trainer.publish(PREFIX, g1)
        target = blank_like(g1)
        with subscribers(srv.url, PREFIX, [target], deltas=False) as (sub,):
            sub.update(timeout=30)
            g2 = changed(g1, 2)
            trainer.publish(PREFIX, g2)
            sub.update(timeout=30)
            assert [r.way for r in sub.updates] == ["relay", "relay"] and same_bytes(g2, target)


def test_a_delta_read_that_fails_before_writing_keeps_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    g1 = model_tensors(1)

    async def refused(*args: Any, **kw: Any) -> Any:
        raise ConnectError("the origin went away before answering")

    with published() as (srv, trainer):
        n1 = trainer.publish(PREFIX, g1).number
        target = blank_like(g1)
        with subscribers(srv.url, PREFIX, [target]) as (sub,):
            sub.update(timeout=30)
            g2 = changed(g1, 2)
            trainer.publish(PREFIX, g2)
            monkeypatch.setattr(subscriber_module.delta_reads, "read", refused)
            sub.update(timeout=30)
            record = last(sub)  # the relay started from a reader still holding g1
            assert (record.way, record.base) == ("relay", n1) and "ConnectError" in record.fallback
            assert same_bytes(g2, target)
