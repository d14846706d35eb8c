"""``bench transfer``'s rdma part measures rdma:// next to the bare engine (a child process with one
registered buffer) moving the same bytes, in the engine's TCP mode, on tiny sizes; and reports
its figures as None, with the reason, where the engine cannot run (``bench transfer`` itself, run
without TENSORWIRE_RDMA_PROTOCOL on a host without RDMA devices, is test_bench_smoke.py)."""

from __future__ import annotations

import pytest
import torch

import tensorwire
from tensorwire import ServerThread
from tensorwire.bench import rdma as rdma_bench
from tensorwire.bench.children import Child, spawned
from tensorwire.testing import rdma as kit
from tensorwire.transport import rdma_engine


@pytest.mark.skipif(kit.unavailable() is not None, reason=f"rdma:// cannot run: {kit.unavailable()}")
def test_rdma_is_measured_next_to_the_bare_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in kit.TCP_MODE.items():
        monkeypatch.setenv(key, value)
    data = torch.rand(1 << 18)  # 1 MiB: through the engine
    with spawned() as children, ServerThread(["rdma://127.0.0.1:0"]) as srv:
        children.append(Child(rdma_bench.engine_peer, data.nbytes))
        peer = children[0].ready()
        assert isinstance(peer, tuple)
        with tensorwire.connect(srv.url) as client:
            result = rdma_bench.measure(client, data, 2, rdma_bench.EnginePeer(*peer))
    for key in rdma_bench.KEYS:
        value = result[key]
        assert isinstance(value, float) and value > 0, key
    assert result["rdma_note"] == "engine protocol tcp"
    assert rdma_bench.rows(result, format)  # the table shows them


def test_without_rdma_the_figures_are_none_and_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rdma_engine.PROTOCOL_ENV, "nonsense")
    reason = rdma_engine.unavailable()
    assert reason is not None and rdma_engine.PROTOCOL_ENV in reason
    skipped = rdma_bench.skipped(reason)
    assert all(skipped[key] is None for key in rdma_bench.KEYS) and skipped["rdma_note"] == reason
