"""Ray Direct Transport through tensorwire (``tensorwire.ray.transport``) on a local Ray cluster (2
CPUs, one node, started once for this module; three actors): an actor's returned tensors reach
another actor and the driver bit-exact, whatever their dtype and size; a reader whose sender was
killed gets an error naming the object and its store, not a hang; a freed object leaves the
sender's store."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch

from tensorwire.store.shm import clean_stale
from tensorwire.types import KiB, MiB
from tensorwire.wire import shm as ws
from tensorwire.wire.tensors import byte_view

ray = pytest.importorskip("ray", reason="tensorwire.ray needs Ray: pip install 'tensorwire[ray]'")
from tensorwire.bench.peers_ray import start_ray  # noqa: E402 - Ray, once more if its first start ran out
from tensorwire.ray import transport  # noqa: E402 - needs Ray

# Before the classes below: Ray checks the name when @ray.method is applied, and registers the
# transport on each actor it creates after.
transport.register()
# Ray's workers cannot import this test module: its actors and helpers travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

DEADLINE = 60.0  # a read that hangs fails the test here (the transport's own bound is 30 s)
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
SHAPES = ((), (0,), (KiB,))  # 0-dim, empty, 1 KiB of elements
BIG = 64 * MiB


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The same tensor in every process that asks for it (a seeded generator)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, shape, generator=gen)
    return torch.randn(shape, generator=gen).to(dtype)


def cases() -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    return [(d, s, seed) for seed, (d, s) in enumerate((d, s) for d in DTYPES for s in SHAPES)]


def big_shape(dtype: torch.dtype) -> tuple[int, ...]:
    return (BIG // dtype.itemsize // 1024, 1024)


def digest(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    """What a tensor is, bit for bit: its dtype, its shape and a hash of its bytes."""
    return str(t.dtype), tuple(t.shape), hashlib.sha256(byte_view(t.contiguous())).hexdigest()


@ray.remote(num_cpus=0, max_restarts=0)
class Producer:
    @ray.method(tensor_transport="tensorwire")
    def tensors(self, specs: list[tuple[torch.dtype, tuple[int, ...], int]]) -> list[torch.Tensor]:
        return [make(*spec) for spec in specs]

    def pid(self) -> int:
        import os

        return os.getpid()

    def store(self) -> dict[str, int]:
        return transport.local_store_stats()


@ray.remote(num_cpus=0, max_restarts=0, enable_tensor_transport=True)  # a reader needs it too
class Consumer:
    def digests(self, tensors: list[torch.Tensor]) -> list[tuple[str, tuple[int, ...], str]]:
        return [digest(t) for t in tensors]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        start_ray(
            ray,
            address="local",
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=100 * MiB,  # the tensors go through tensorwire, not Ray's store
            logging_level=logging.WARNING,
        )
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def actors(cluster: None) -> Iterator[tuple[Any, Any]]:
    producer, consumer = Producer.remote(), Consumer.remote()  # type: ignore[attr-defined]
    try:
        yield producer, consumer
    finally:
        ray.kill(producer)
        ray.kill(consumer)


def store_of(producer: Any) -> dict[str, int]:
    return ray.get(producer.store.remote(), timeout=DEADLINE)  # type: ignore[no-any-return]


def test_every_dtype_and_size_reaches_an_actor_and_the_driver_bit_exact(actors: tuple[Any, Any]) -> None:
    producer, consumer = actors
    specs = cases()
    expected = [digest(make(*spec)) for spec in specs]
    ref = producer.tensors.remote(specs)
    assert ray.get(consumer.digests.remote(ref), timeout=DEADLINE) == expected
    assert [digest(t) for t in ray.get(ref, timeout=DEADLINE)] == expected
    for seed, dtype in enumerate(DTYPES, start=100):  # 64 MiB each, one object at a time
        spec = (dtype, big_shape(dtype), seed)
        ref = producer.tensors.remote([spec])
        want = [digest(make(*spec))]
        assert ray.get(consumer.digests.remote(ref), timeout=DEADLINE) == want, dtype
        assert [digest(t) for t in ray.get(ref, timeout=DEADLINE)] == want, dtype
        del ref


def wait_store(producer: Any, objects: int) -> dict[str, int]:
    """The producer's store once it holds ``objects`` objects (Ray frees them asynchronously)."""
    gc.collect()
    deadline = time.monotonic() + DEADLINE
    while (now := store_of(producer))["objects"] != objects:
        assert time.monotonic() < deadline, f"the sender's store holds {now}, not {objects} objects"
        time.sleep(0.05)
    return now


def test_a_freed_object_leaves_the_senders_store(actors: tuple[Any, Any]) -> None:
    producer, consumer = actors
    spec = (torch.float32, big_shape(torch.float32), 7)
    assert wait_store(producer, 0)["bytes"] == 0  # what earlier tests made is gone
    ref = producer.tensors.remote([spec])
    assert ray.get(consumer.digests.remote(ref), timeout=DEADLINE) == [digest(make(*spec))]
    assert store_of(producer) == {"tensors": 1, "bytes": BIG, "objects": 1}
    del ref
    assert wait_store(producer, 0) == {"tensors": 0, "bytes": 0, "objects": 0}


def test_a_killed_sender_gives_its_readers_an_error_naming_what_failed(actors: tuple[Any, Any]) -> None:
    _, consumer = actors
    victim = Producer.remote()  # type: ignore[attr-defined]
    pid = ray.get(victim.pid.remote(), timeout=DEADLINE)
    ref = victim.tensors.remote([(torch.float32, (KiB,), 3)])
    ray.wait([ref], timeout=DEADLINE)  # made, and in its store
    ray.kill(victim)
    with contextlib.suppress(psutil.NoSuchProcess):  # gone already
        psutil.Process(pid).wait(DEADLINE)
    try:
        with pytest.raises(transport.SenderUnreachable) as driver:
            ray.get(ref, timeout=DEADLINE)  # a hang would be GetTimeoutError
        assert ref.hex() in str(driver.value) and "may have died" in str(driver.value)
        with pytest.raises(ray.exceptions.RayTaskError) as actor:
            ray.get(consumer.digests.remote(ref), timeout=DEADLINE)
        assert isinstance(actor.value.cause, transport.SenderUnreachable)
        assert ref.hex() in str(actor.value.cause)
    finally:
        clean_stale(ws.shm_dir())  # the segments the killed actor's store left
