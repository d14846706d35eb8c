"""rdma:// in the engine's TCP mode: the conformance suite every transport passes, and the path's
own promises (large tensors move through the engine, small ones in frames, no silent fallback)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

import tensorwire
from tensorwire import ServerThread
from tensorwire._aio import run
from tensorwire.errors import ProtocolError, RdmaUnavailable
from tensorwire.testing import rdma as kit
from tensorwire.testing.conformance import CASES, Case, run_case
from tensorwire.transport import CHANNEL_SCHEMES, TransportOptions, open_channel, open_transport, rdma_engine
from tensorwire.transport.base import FrameChannel, Ranged, Resumable, Viewable
from tensorwire.types import Address
from tensorwire.wire import rdma as wr
from tensorwire.wire.frame import Opcode

pytestmark = pytest.mark.skipif(
    kit.unavailable() is not None, reason=f"rdma:// cannot run: {kit.unavailable()}"
)


@pytest.fixture(autouse=True)
def tcp_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in kit.TCP_MODE.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("scheme", ["rdma", "rdmas"])  # rdmas://: the control connection in TLS
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_conformance_over_rdma(case: Case, scheme: str) -> None:
    run_case(case, scheme)


def test_large_tensors_move_through_the_engine_and_are_unregistered_after() -> None:
    big, small = torch.randn(1 << 20), torch.arange(100)
    with ServerThread(["rdma://127.0.0.1:0"]) as srv, tensorwire.connect(srv.url) as client:
        client.put_many({"big": big, "small": small})
        out = torch.empty_like(big)
        client.get("big", out=out)
        assert torch.equal(out, big)
        assert torch.equal(client.get("small"), small)
        status = srv.server.status()["rdma"]
        assert status["protocol"] == "tcp"
        # The get's copy is released in the background: poll with a deadline.
        assert _eventually(lambda: srv.server.status()["rdma"]["registered_buffers"] == 0)


def test_rdma_says_what_it_can_do() -> None:
    """A frame channel (STATUS, the parameter server's requests go over it), not Ranged: its large
    bytes move through the engine, not frames (asked of the object, as for every transport)."""

    async def ask(url: str) -> tuple[bool, ...]:
        t = await open_transport(Address.parse(url), TransportOptions(5.0, 5.0))
        try:
            return tuple(isinstance(t, kind) for kind in (FrameChannel, Ranged, Resumable, Viewable))
        finally:
            await t.close()

    with ServerThread(["rdma://127.0.0.1:0"]) as srv:
        assert run(ask(srv.url)) == (True, False, False, False)
    assert "rdma" in CHANNEL_SCHEMES


def test_a_tcp_listener_of_the_same_server_registers_nothing() -> None:
    """The same server's tcp:// connections may not make it register memory with its engine."""

    async def attach(url: str) -> None:
        options = TransportOptions(connect_timeout=5.0, request_timeout=5.0)
        channel = await open_channel(url, options, what="the test")
        try:
            await channel.call(Opcode.RDMA_ATTACH, wr.encode_attach_request("tcp"), what="RDMA_ATTACH")
        finally:
            await channel.close()

    with ServerThread(["rdma://127.0.0.1:0", "tcp://127.0.0.1:0"]) as srv:
        with pytest.raises(ProtocolError, match="only on the rdma"):
            run(attach(str(srv.addresses[1])))
        assert srv.server.status()["rdma"]["registered_buffers"] == 0


def test_no_silent_fallback_without_rdma_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rdma_engine.PROTOCOL_ENV, "rdma")
    probe = rdma_engine.load().TransferEngine()
    if rdma_engine.rdma_devices(probe.get_local_topology("")):
        pytest.skip("this host has RDMA devices: the engine's rdma protocol is real here")
    with pytest.raises(RdmaUnavailable, match="TENSORWIRE_RDMA_PROTOCOL=tcp"):
        ServerThread(["rdma://127.0.0.1:0"])


def _eventually(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return False


def test_buffers_inside_or_across_registered_ones_are_served() -> None:
    """The client keeps the buffers it moved registered; a later get into a slice of one (inside
    it) or into a buffer that overlaps an idle one (the engine refuses overlapping registrations)
    still works."""
    whole = torch.randn(1 << 20)
    with ServerThread(["rdma://127.0.0.1:0"]) as srv, tensorwire.connect(srv.url) as client:
        client.put("whole", whole)
        half = whole[: 1 << 19].clone()
        client.put("half", half)
        inside = whole[1 << 18 : (1 << 18) + (1 << 19)]  # a view inside the registered `whole`
        client.get("half", out=inside)
        assert torch.equal(inside, half)
        bigger = torch.empty(1 << 21)
        client.put("big", bigger.normal_())
        across = bigger[(1 << 20) - 7 : (1 << 20) - 7 + (1 << 19)]  # inside `bigger` too
        client.get("half", out=across)
        assert torch.equal(across, half)
        fresh = torch.randn(1 << 20)
        client.put("front", fresh[: 1 << 19])  # registers the front half of `fresh` only
        straddling = fresh[1 << 18 : (1 << 18) + (1 << 19)]  # half in that region, half past it
        client.get("half", out=straddling)
        assert torch.equal(straddling, half)
