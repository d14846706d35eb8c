"""``bench transfer`` measures rdma:// next to the bare engine in the same run (engine TCP mode),
and reports the rdma figures as None, with the reason, where the engine cannot run."""

from __future__ import annotations

import pytest

from tensorwire.bench import rdma as rdma_bench
from tensorwire.bench.transfer import main
from tensorwire.testing import rdma as kit
from tensorwire.transport import rdma_engine


@pytest.mark.skipif(kit.unavailable() is not None, reason=f"rdma:// cannot run: {kit.unavailable()}")
def test_transfer_bench_reports_rdma_next_to_the_bare_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in kit.TCP_MODE.items():
        monkeypatch.setenv(key, value)
    tiny = [
        "--size",
        "1MiB",
        "--iters",
        "1",
        "--small-iters",
        "20",
        "--many",
        "100",
        "--ping-put-size",
        "1MiB",
    ]
    result = main(tiny)
    for key in rdma_bench.KEYS:
        value = result[key]
        assert isinstance(value, float) and value > 0, key
    assert result["rdma_note"] == "engine protocol tcp"


def test_without_rdma_the_figures_are_none_and_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rdma_engine.PROTOCOL_ENV, "nonsense")
    reason = rdma_engine.unavailable()
    assert reason is not None and rdma_engine.PROTOCOL_ENV in reason
    skipped = rdma_bench.skipped(reason)
    assert all(skipped[key] is None for key in rdma_bench.KEYS) and skipped["rdma_note"] == reason
