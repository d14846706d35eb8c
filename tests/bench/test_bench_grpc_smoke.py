"""The gRPC benchmark runs end to end on a tiny size and reports every number (never timings)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tensorwire.bench.grpc import main

ALWAYS = [
    "grpc_put_gbps",
    "grpc_get_gbps",
    "naive_put_gbps",
    "naive_get_gbps",
    "put_vs_naive",
    "get_vs_naive",
    "grpc_discard_put_gbps",
    "grpc_discard_get_gbps",
    "grpc_put_vs_discard",
    "grpc_get_vs_discard",
]
FLIGHT = ["flight_put_gbps", "flight_get_gbps", "put_vs_flight", "get_vs_flight"]


def test_grpc_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    result = main(["--size", "1MiB", "--iters", "1", "--json"])

    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == result
    has_arrow = importlib.util.find_spec("pyarrow") is not None
    for key in ALWAYS + FLIGHT:
        value = result[key]
        if key in FLIGHT and not has_arrow:
            assert value is None, key  # the only case a number may be missing
            continue
        assert isinstance(value, int | float) and not isinstance(value, bool), key
        assert value > 0, key
    assert result["size_bytes"] == 1 << 20
    assert result["iters"] == 1
    assert isinstance(result["pinned"], bool)
    assert (result["pyarrow"] is None) == (not has_arrow)
