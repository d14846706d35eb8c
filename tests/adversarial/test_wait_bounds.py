"""GEN_WAIT (docs/protocol.md §14, "Waits"; issue 32, classes 4 and 5): one client host parks at
most ``--waiters-per-client`` waits whatever number of connections it opens, each refusal names
the flag that sets its bound, and a wait's answer counts against the store's capacity while it is
sent (with no room, CapacityExceeded naming --capacity rather than memory nobody counts)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import tensorwire
from tensorwire.errors import CapacityExceeded, LimitExceeded
from tensorwire.server.options import ServerOptions
from tensorwire.store import TensorStore
from tensorwire.store.generations import GenerationConfig
from tensorwire.store.memory import entry_cost
from tensorwire.testing.process import wait_for


async def _park(client: tensorwire.AsyncClient, count: int) -> list[asyncio.Future[object]]:
    waits = [asyncio.ensure_future(client.wait("w", 0, timeout=20)) for _ in range(count)]
    await asyncio.sleep(0)
    return waits  # type: ignore[return-value]


async def _refused(waits: list[asyncio.Future[object]], says: str) -> list[asyncio.Future[object]]:
    """The one wait of ``waits`` that is refused (LimitExceeded saying ``says``); the others."""
    done, _ = await asyncio.wait_for(asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), 10)
    assert len(done) == 1
    with pytest.raises(LimitExceeded, match=says):
        done.pop().result()
    return [w for w in waits if not w.done()]


def test_one_client_host_parks_a_bounded_number_of_waits_over_all_its_connections() -> None:
    config = GenerationConfig(waiters_per_owner=2, waiters_per_client=3, max_waiters=100)
    with tensorwire.ServerThread(options=ServerOptions(generations=config)) as srv:
        ops = srv.server.generation_ops

        async def main() -> None:
            a, b = await tensorwire.aconnect(srv.url), await tensorwire.aconnect(srv.url)
            try:
                held = await _refused(await _park(a, 3), r"at most 2 \(--waiters-per-connection\)")
                held += await _refused(
                    await _park(b, 2), r"3 waits parked: at most 3 \(--waiters-per-client\)"
                )
                assert ops.waiting == 3
                async with await tensorwire.aconnect(srv.url) as pub:
                    gen = await pub.publish("w", {"x": torch.zeros(1)})
                assert all(r == gen for r in await asyncio.gather(*held))
            finally:
                await a.close()
                await b.close()

        asyncio.run(main())
        wait_for(lambda: ops.waiting == 0 and not ops._client_waits, 10, "every wait to be uncounted")


def test_a_wait_answer_counts_against_the_capacity() -> None:
    store = TensorStore(capacity=1 << 20)
    with tensorwire.ServerThread(store=store) as srv, tensorwire.connect(srv.url, retries=0) as c:
        keys = {f"k{i:04d}": torch.zeros(1) for i in range(200)}  # a generation block of ~2 KiB
        gen = c.publish("w", keys)
        room = store.capacity - store.used
        c.put("filler", torch.zeros(room - entry_cost("filler") - 512, dtype=torch.uint8))  # 512 bytes left
        with pytest.raises(CapacityExceeded, match="--capacity"):
            c.wait("w", 0, timeout=5)
        c.delete("filler")
        assert c.wait("w", 0, timeout=5) == gen
        wait_for(lambda: store.scratch_bytes == 0, 10, "what the answer held to be given back once sent")
