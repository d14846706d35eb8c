"""rdma:// in the engine's TCP mode: the memory the engine is told about counts in the one capacity
(issue 32, class 5), and giving a request's buffers back never cuts other peers' connections.

* A put lands in a buffer of the engine's own before it is copied into the store's reservation:
  that landing buffer is memory a peer caused, so it counts against ``--capacity`` from the moment
  it is taken. Peers opening puts they never end cannot make the process hold more than the
  capacity (reservations and landing buffers together).
* A get's copies go back to the engine's memory when the get is released. On a fairly full store
  that must not fail to be counted (and so set off a reclaim, which cuts every peer's engine
  connection): the copies were counted when taken, and stay counted while they wait for reuse.

Real servers on loopback, the client's own engine, no mocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tensorwire
from tensorwire import Server, ServerThread, TensorStore
from tensorwire._aio import run
from tensorwire.errors import CapacityExceeded
from tensorwire.security import Security
from tensorwire.server.rdma import RdmaService
from tensorwire.server.rdma_memory import size_class
from tensorwire.testing import rdma as kit
from tensorwire.testing.process import wait_for
from tensorwire.transport import FrameChannel, TransportOptions, open_channel
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.frame import Opcode

pytestmark = pytest.mark.skipif(
    kit.unavailable() is not None, reason=f"rdma:// cannot run: {kit.unavailable()}"
)
MIB = 1 << 20


@pytest.fixture(autouse=True)
def tcp_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in kit.TCP_MODE.items():
        monkeypatch.setenv(key, value)


def _service(server: Server) -> RdmaService:
    return next(e for e in server.extensions if isinstance(e, RdmaService))


def test_a_puts_landing_buffer_counts_against_the_capacity() -> None:
    """A peer opens puts (RDMA_PUT) and never ends them: each holds its reservation and its landing
    buffer. Both count in ``used``, so the capacity refuses the next put once they fill it: what
    they hold passes the capacity by at most the one put whose own landing was admitted last."""
    capacity = 8 * MIB

    async def case() -> None:
        server = Server(store=TensorStore(capacity))
        await server.start("rdma://127.0.0.1:0")
        options = TransportOptions(5.0, 5.0, security=Security())
        channel: FrameChannel = await open_channel(server.addresses[0], options, what="the test")
        try:
            opened = 0
            for i in range(2 * capacity // MIB):  # more than fit, were landing buffers free
                meta = TensorMeta(f"t{i}", torch.uint8, (MIB,), MIB)
                try:
                    await channel.call(Opcode.RDMA_PUT, wm.encode_records([meta]), what="RDMA_PUT")
                except CapacityExceeded as exc:
                    assert "--capacity" in str(exc)
                    break
                opened += 1
            memory = _service(server).memory
            assert memory is not None and memory.held == opened * size_class(MIB)
            assert server.store.charged.get("rdma.engine") == memory.held  # counted in used
            held = memory.held + server.store.reserved
            assert held <= capacity + size_class(MIB), f"{opened} open puts hold {held} bytes"
            assert 1 <= opened < 2 * capacity // MIB
        finally:
            await channel.close()
            await server.close()

    run(case())


def test_a_released_get_on_a_fairly_full_store_cuts_no_connection() -> None:
    """Two stored tensors, one get of both: one copy reuses the idle landing buffer, the other is
    new. The get's release hands both back while the store is fairly full: nothing is reclaimed,
    so the engine connections open before the get (every peer's) are all still open after it."""
    size = size_class(MIB)

    with ServerThread(["rdma://127.0.0.1:0"], store=TensorStore(5 * size + size // 2)) as srv:
        service = _service(srv.server)
        memory = service.memory
        assert memory is not None
        with tensorwire.connect(srv.url) as client:
            client.put("x", torch.ones(MIB, dtype=torch.uint8))
            client.put("y", torch.full((MIB,), 2, dtype=torch.uint8))
            before = {s.inode for s in service.engine.sockets.connections(service.engine.data_ports)}
            assert before  # the client's engine reached the data port
            got = client.get_many(["x", "y"])
            assert torch.equal(got["y"], torch.full((MIB,), 2, dtype=torch.uint8))
            # Settled: the get's reservation closed and every buffer back (or reclaimed): the server
            # thread gives the buffers back just after the reservation leaves the open count.
            wait_for(lambda: _settled(srv.server.status()["rdma"]), 10.0, "the get's release")
            status = srv.server.status()["rdma"]["engine_memory"]
            assert status["reclaims"] == 0 and status["idle"] == 2 * size, status
            after = {s.inode for s in service.engine.sockets.connections(service.engine.data_ports)}
            assert before <= after, "the release cut the engine's connections"
            client.put("z", torch.ones(MIB, dtype=torch.uint8))  # and the engine still serves
        assert srv.server.store.charged.get("rdma.engine") == memory.held
        assert srv.server.store.used <= srv.server.store.capacity


def _settled(rdma: dict[str, Any]) -> bool:
    """No reservation open, and no engine buffer in use: every one idle, or freed by a reclaim."""
    memory = rdma["engine_memory"]
    return bool(rdma["open"] == 0 and memory["held"] == memory["idle"])
