"""Generations end to end (README, "Generations"; docs/protocol.md §14): a real server process on
loopback (``tensorwire serve --keep-generations 2``), and in-process servers where a test needs
its own capacity."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import tensorwire
import tensorwire._aio
from tensorwire.errors import CapacityExceeded, GenerationRetired, KeyNotFound, WaitTimeout
from tensorwire.store import TensorStore
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.types import MiB
from tensorwire.wire import generations as wg

N = 4  # tensors per generation
ELEMS = 64 * 1024  # 256 KiB of float32 each: a read takes long enough to race a publish


def filled(g: int) -> dict[str, torch.Tensor]:
    """Generation ``g``: every tensor filled with ``g``."""
    return {f"t{i}": torch.full((ELEMS,), float(g)) for i in range(N)}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    flags = ["--keep-generations", "2", "--max-lease-seconds", "30"]
    with ServerProcess(capacity="256MiB", extra=flags) as srv:
        yield srv


@pytest.fixture
def client(server: ServerProcess) -> Iterator[tensorwire.Client]:
    with tensorwire.connect(server.url) as c:
        yield c


def test_a_reader_racing_a_publisher_never_sees_a_mix(server: ServerProcess) -> None:
    names = [f"race/t{i}" for i in range(N)]
    stop = threading.Event()
    seen: set[float] = set()  # generations the readers read
    mixes: list[str] = []

    def publisher() -> None:
        with tensorwire.connect(server.url) as c:
            for g in range(1, 41):
                assert c.publish("race", filled(g)).number == g
        stop.set()

    def reader() -> None:
        with tensorwire.connect(server.url) as c:
            c.wait("race", 0, timeout=30)
            while not stop.is_set():
                got = c.get_many(names, at="latest")
                values = {float(t[0]) for t in got.values()} | {float(t[-1]) for t in got.values()}
                if len(values) != 1:
                    mixes.append(f"one read saw generations {sorted(values)}")
                seen.update(values)

    threads = [threading.Thread(target=publisher), *(threading.Thread(target=reader) for _ in range(3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not mixes
    assert len(seen) > 1  # the readers did read while the publisher published


def test_reads_at_a_number_and_latest_and_the_manifest(client: tensorwire.Client) -> None:
    first = client.publish("at", {"w": torch.arange(10.0), "b": torch.ones(3, dtype=torch.bfloat16)})
    second = client.publish("at", {"w": torch.arange(10.0) * 2, "b": torch.zeros(3, dtype=torch.bfloat16)})
    assert (first.number, second.number) == (1, 2)
    assert first.names == ("at/b", "at/w") and first.nbytes == 46 and first.digest != second.digest
    assert torch.equal(client.get("at/w", at=1), torch.arange(10.0))
    assert torch.equal(client.get("at/w", at="latest"), torch.arange(10.0) * 2)
    out = {"at/w": torch.empty(10), "at/b": torch.empty(3, dtype=torch.bfloat16)}
    got = client.get_many(["at/w", "at/b"], at=1, out=out, verify=True)
    assert got["at/w"] is out["at/w"] and torch.equal(out["at/b"], torch.ones(3, dtype=torch.bfloat16))
    manifest = client.manifest("at", at=1)
    assert manifest.generation == first
    assert (manifest.chunk_size, manifest.checksum_kind) == (wg.CHUNK_BYTES, int(wg.CHECKSUM_KIND))
    entry = manifest.tensor("at/w")
    assert entry.meta == ("at/w", torch.float32, (10,), 40, 1)
    assert entry.checksums == wg.chunk_checksums(torch.arange(10.0).numpy().tobytes())
    assert wg.root_digest(manifest.tensors, manifest.chunk_size, manifest.checksum_kind) == first.digest
    assert client.manifest("at").generation == second
    # One chunk range, checked against the manifest's checksum: what a relay does.
    offset, length, want = manifest.chunk("at/w", 0)
    piece = client.get_range("at/w", at=1, offset=offset, length=length)
    assert wg.chunk_checksums(piece.numpy().tobytes()) == (want,)
    with pytest.raises(KeyNotFound, match="no generation 3"):
        client.get("at/w", at=3)


def test_wait_wakes_on_a_publish_while_its_connection_serves_others(server: ServerProcess) -> None:
    async def main() -> None:
        waiter, pub = await tensorwire.aconnect(server.url), await tensorwire.aconnect(server.url)
        async with waiter, pub:
            await pub.publish("wake", {"x": torch.zeros(1)})
            parked = asyncio.ensure_future(waiter.wait("wake", after=1, timeout=20))
            await waiter.put("wake-side", torch.ones(2))  # the same connection answers meanwhile
            assert torch.equal(await waiter.get("wake-side"), torch.ones(2))
            assert not parked.done()
            started = time.monotonic()
            gen = await pub.publish("wake", {"x": torch.ones(1)})
            assert await asyncio.wait_for(parked, 10) == gen
            assert time.monotonic() - started < 5
            assert (await waiter.wait("wake", after=0, timeout=1)).number == 2  # at once: one exists
            with pytest.raises(WaitTimeout, match=r"'wake' after 2"):
                await waiter.wait("wake", after=2, timeout=0.2)

    tensorwire._aio.run(main())


def test_the_last_k_are_kept_and_a_retired_read_names_the_oldest(client: tensorwire.Client) -> None:
    for g in range(1, 5):
        client.publish("keep", filled(g))
    assert float(client.get("keep/t0", at=3)[0]) == 3.0
    with pytest.raises(GenerationRetired, match=r"generation 2 of 'keep' is retired; the oldest kept is 3"):
        client.get_many(["keep/t0", "keep/t1"], at=2)


def test_a_lease_keeps_a_generation_past_k_until_it_runs_out(client: tensorwire.Client) -> None:
    client.publish("lease", filled(1))
    lease = client.lease("lease", 1, seconds=0.5)
    assert lease.seconds == pytest.approx(0.5)
    for g in range(2, 5):
        client.publish("lease", filled(g))
    assert float(client.get("lease/t0", at=1)[0]) == 1.0  # kept past the last two, leased

    def retired() -> bool:
        try:
            client.get("lease/t0", at=1)
        except GenerationRetired:
            return True
        return False

    wait_for(retired, 10, "the lease on generation 1 to run out")
    with pytest.raises(GenerationRetired):
        client.lease("lease", 1, seconds=5)
    with client.lease("lease", 4, seconds=60) as held:  # granted at most --max-lease-seconds
        assert held.seconds == pytest.approx(30) and held.oldest == 3


def test_a_generation_over_the_capacity_is_refused_and_the_previous_stays() -> None:
    store = TensorStore(capacity=12 * MiB)
    with tensorwire.ServerThread(store=store) as srv, tensorwire.connect(srv.url) as c:
        c.publish("cap", {"w": torch.full((MiB,), 1.0)})  # 4 MiB
        before = srv.server.store.used
        with pytest.raises(CapacityExceeded):
            c.publish("cap", {"w": torch.full((2 * MiB,), 2.0)})  # 8 MiB more does not fit beside it
        assert srv.server.store.used == before
        assert float(c.get("cap/w", at="latest")[0]) == 1.0 and c.manifest("cap").generation.number == 1
        c.publish("cap", {"w": torch.full((MiB,), 3.0)})  # fits beside generation 1 (kept: 2)
        assert c.manifest("cap").generation.number == 2
