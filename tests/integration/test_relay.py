"""The relay with real servers on loopback: N Subscribers read one generation bit-exactly while
the origin sends its bytes about once (docs/protocol.md §15)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import tensorwire
from tensorwire.broadcast import Chains, RelayCoordinator
from tensorwire.broadcast.source import StoreSource
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.testing.process import run_threads

PREFIX = "policy/"


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(256, 300, generator=gen),  # ~300 KiB
        "fc1.bias": torch.randn(256, generator=gen).to(torch.bfloat16),
        "fc2.weight": torch.randn(64, 256, generator=gen).to(torch.float16),
        "steps": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(1000, generator=gen) > 0.5,
        "empty": torch.empty(0),
    }


def blank_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in tensors.items()}


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a
    )


@pytest.fixture
def origin() -> Iterator[tuple[ServerThread, RelayCoordinator]]:
    store = TensorStore()
    coordinator = RelayCoordinator(store, source=StoreSource(store, chunk_bytes=16 << 10))
    with ServerThread(store=store, extensions=[coordinator]) as srv:
        yield srv, coordinator


def publish(url: str, tensors: dict[str, torch.Tensor]) -> int:
    with tensorwire.connect(url) as client:
        return client.put_many({PREFIX + k: v for k, v in tensors.items()})


def test_four_subscribers_in_threads_read_bit_exact_and_the_origin_sends_about_once(origin) -> None:
    srv, coordinator = origin
    model = model_tensors(1)
    generation = publish(srv.url, model)
    targets = [blank_like(model) for _ in range(4)]
    subs = [tensorwire.Subscriber(srv.url, PREFIX, t, listen_host="127.0.0.1") for t in targets]
    try:
        got = [0] * 4

        def read(i: int) -> None:
            got[i] = subs[i].update(timeout=30)

        run_threads(read, 4, timeout=60)
        assert got == [generation] * 4
        assert all(same_bytes(model, t) for t in targets)
        stats = subs[0].stats()
        (gen,) = stats["generations"]
        model_bytes = sum(v.nbytes for v in model.values())
        assert gen["model_bytes"] == model_bytes
        assert gen["served_bytes"] <= 1.1 * model_bytes, stats  # about once, not 4x
        assert gen["readers"] == 4 and gen["done"] == 4
        assert subs[0].update(timeout=30) == generation  # nothing newer: nothing moves
    finally:
        for sub in subs:
            sub.close()


def test_a_second_generation_reaches_every_reader(origin) -> None:
    srv, _ = origin
    first = model_tensors(1)
    publish(srv.url, first)
    targets = [blank_like(first) for _ in range(3)]
    subs = [tensorwire.Subscriber(srv.url, PREFIX, t, listen_host="127.0.0.1") for t in targets]
    try:
        run_threads(lambda i: subs[i].update(timeout=30), 3, timeout=60)
        second = model_tensors(2)
        g2 = publish(srv.url, second)
        got = [0] * 3

        def read(i: int) -> None:
            got[i] = subs[i].update(timeout=30)

        run_threads(read, 3, timeout=60)
        assert got == [g2] * 3
        assert all(same_bytes(second, t) for t in targets)
    finally:
        for sub in subs:
            sub.close()
