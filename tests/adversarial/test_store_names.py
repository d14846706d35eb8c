"""Item 9: every stored name costs capacity, and the number of tensors is bounded.

210,000 zero-byte tensors were accepted by a 1 MiB server (``used`` stayed 0 while its memory
grew by 340 MiB). A name costs ``entry_cost`` (1 KiB plus its bytes) in ``used``, and a store
holds at most ``max_tensors`` (``serve --max-tensors``) through every way a tensor gets in.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import pytest
import torch

import tensorwire
from tensorwire._aio import run
from tensorwire.cli.status import ask_status
from tensorwire.client import Client, ClientOptions
from tensorwire.errors import CapacityExceeded, ErrorCode
from tensorwire.server import Server, ServerThread
from tensorwire.store import TensorStore
from tensorwire.store.memory import entry_cost
from tensorwire.testing.conformance import put_frame, raw, read_reply
from tensorwire.testing.process import ServerProcess
from tensorwire.types import MiB, TensorMeta
from tensorwire.wire import meta as wm

EMPTY = torch.zeros(0)


def test_empty_tensors_fill_a_small_store() -> None:
    with ServerThread(store=TensorStore(1 * MiB)) as srv, tensorwire.connect(srv.url) as c:
        stored = 0
        with pytest.raises(CapacityExceeded, match="--capacity"):
            for batch in range(10):  # 5,000 names: far more than 1 MiB of names
                c.put_many({f"empty/{batch}/{i:04d}": EMPTY for i in range(500)})
                stored += 500
        assert stored < 1 * MiB // entry_cost("empty/0/0000")
        store = srv.server.store
        assert store.used == store.metadata == sum(entry_cost(m.name) for m in store.list())
        status = srv.server.status()["store"]
        assert status["used"] == store.used and status["metadata"] == store.used


def test_serve_max_tensors_is_enforced_and_shown() -> None:
    with ServerProcess(capacity="64MiB", extra=["--max-tensors", "3"]) as srv:
        with tensorwire.connect(srv.url) as c:
            c.put_many({"a": EMPTY, "b": EMPTY, "c": EMPTY})
            with pytest.raises(CapacityExceeded, match="--max-tensors"):
                c.put("d", EMPTY)
            c.put("a", torch.ones(4))  # replacing a name needs no new one
            c.delete("b")
            c.put("d", EMPTY)  # a deleted name makes room
        status = run(ask_status(srv.url, ClientOptions(timeout=10.0)))["store"]
        assert status["max_tensors"] == 3 and status["tensors"] == 3
        assert status["used"] == status["bytes"] + status["metadata"] > 16


def striped(c: Client, name: str) -> int:
    return c.put(name, torch.ones(1 * MiB))  # 4 MiB over two connections (stripes=2 below)


def resumable(c: Client, name: str) -> int:
    return c.put(name, torch.ones(16))  # resumable_bytes=1 below: PUT_RESUMABLE


PATHS: dict[str, tuple[str, dict[str, object], Callable[[Client, str], int]]] = {
    "put": ("tcp", {}, lambda c, name: c.put(name, torch.ones(4))),
    "put_many": ("tcp", {}, lambda c, name: c.put_many({name: torch.ones(4)})),
    "resumable": ("tcp", {"resumable_bytes": 1}, resumable),
    "striped": ("tcp", {"stripes": 2, "stripe_bytes": 1 * MiB}, striped),
    "grpc": ("grpc", {}, lambda c, name: c.put(name, torch.ones(4))),
}


@pytest.mark.parametrize("path", PATHS)
def test_every_way_in_counts_against_max_tensors(path: str) -> None:
    scheme, options, put = PATHS[path]
    store = TensorStore(64 * MiB, max_tensors=2)
    with ServerThread(["tcp://127.0.0.1:0", "grpc://127.0.0.1:0"], store=store) as srv:
        url = next(str(a) for a in srv.addresses if a.scheme == scheme)
        with tensorwire.connect(url, retries=0, **options) as c:
            put(c, "first")
            put(c, "second")
            with pytest.raises(CapacityExceeded, match="--max-tensors"):
                put(c, "third")
            put(c, "first")  # an overwrite takes no new slot
            assert sorted(m.name for m in c.list()) == ["first", "second"]
        assert len(store) == 2 and store.used == store.stored + store.metadata


async def a_batch_of_many_names_for_a_small_store() -> tuple[int, int]:
    records = [TensorMeta(f"z/{i}", torch.uint8, (0,), 0) for i in range(100_000)]
    frame = put_frame(records, b"")
    srv = Server(store=TensorStore(1 * MiB))
    await srv.start("tcp://127.0.0.1:0")
    try:
        async with raw(srv) as (stream, reader):
            tracemalloc.start()
            try:
                await stream.send([frame])
                header, meta = await read_reply(reader)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        assert header.is_error
        return wm.decode_error(meta)[0], peak
    finally:
        await srv.close()


def test_a_batch_is_weighed_against_the_capacity_before_its_records_are_decoded() -> None:
    """100,000 records (3 MB of metadata) for a store with room for ~1,000 names: refused before
    they become 100,000 Python objects (~30 MB)."""
    code, peak = run(a_batch_of_many_names_for_a_small_store())
    assert code == ErrorCode.CAPACITY_EXCEEDED
    assert peak < 16 * MiB, f"refusing 100,000 records took {peak / MiB:.0f} MiB"
