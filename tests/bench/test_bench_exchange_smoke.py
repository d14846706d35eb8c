"""`tensorwire bench exchange` end to end on tiny gradients: real exchange servers, worker
processes, a gloo group; on loopback, and in network namespaces where this machine allows them."""

from __future__ import annotations

import math

import pytest

from tensorwire.bench import exchange

TINY = ["--bytes", "20000", "--tensors", "4", "--steps", "1", "--warmup", "0", "--timeout", "60"]


def test_bench_exchange_on_loopback_measures_the_three_ways() -> None:
    result = exchange.main(["--no-netns", *TINY])
    assert result["workers"] == 2 and result["servers"] == 2 and "netns_skipped" not in result
    assert result["grad_bytes"] == 20000 and result["tensors"] == 4
    for way in ("tcp", "grpc", "gloo"):
        gbps = result[f"loopback_{way}_gbps"]
        assert math.isfinite(gbps) and gbps > 0, way
    for way in ("tcp", "grpc"):
        assert (
            result[f"loopback_{way}_vs_gloo"] == result[f"loopback_{way}_gbps"] / result["loopback_gloo_gbps"]
        )
    moved = result["loopback_bytes"]
    assert moved["tcp"] == {"worker_sent": 20000, "worker_received": 20000, "all_processes_sent": 80000}
    assert moved["gloo"]["all_processes_sent"] == 40000  # a ring moves half the exchange's bytes
    assert "tcp_gbps" not in result  # no namespace keys on loopback only


def test_bench_exchange_in_network_namespaces() -> None:
    """Needs root (CAP_NET_ADMIN) and `ip`/`tc`: skipped, with the reason, where either is missing."""
    result = exchange.main(["--no-loopback", *TINY])
    if "netns_skipped" in result:
        pytest.skip(result["netns_skipped"])
    assert result["link_gbps"] == 0.125  # 1 Gb/s links
    for way in ("tcp", "grpc", "gloo"):
        assert result[f"{way}_gbps"] > 0, way
        link = result["links"][way]
        assert link["worker_sent"] >= 10000 and link["worker_received"] >= 10000, (way, link)  # measured
    assert result["tcp_vs_gloo"] > 0 and result["grpc_vs_gloo"] > 0
    assert not any(key.startswith("loopback_") for key in result)
