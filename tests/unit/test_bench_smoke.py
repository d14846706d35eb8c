"""The transfer benchmark runs end to end on tiny sizes and reports every number (never timings)."""

from __future__ import annotations

import json

import pytest

from tensorwire.bench.transfer import main

KEYS = [
    "put_gbps",
    "get_gbps",
    "socket_gbps",
    "put_ratio",
    "get_ratio",
    "small_get_us",
    "sync_small_get_us",
    "echo_us",
    "small_ratio",
    "many_small_per_s",
    "many_get_per_s",
    "tls_put_gbps",
    "tls_get_gbps",
    "tls_put_ratio",
    "tls_get_ratio",
    "shm_put_gbps",
    "shm_get_gbps",
    "memcpy_gbps",
    "shm_put_ratio",
    "shm_get_ratio",
    "size_bytes",
    "iters",
    "striped_gbps",
    "one_stream_gbps",
    "striped_ratio",
    "lz4_gbps",
    "zstd_gbps",
    "raw_compressible_gbps",
    "lz4_ratio",
    "zstd_ratio",
    "auto_incompressible_ratio",
    "cache_hit_get_us",
    "cache_leased_get_us",
    "ping_during_put_p99_ms",
    "ping_idle_p99_ms",
]


def test_transfer_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = ["--size", "1MiB", "--iters", "1", "--small-iters", "20", "--many", "100"]
    result = main([*tiny, "--ping-put-size", "1MiB", "--json"])

    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == result
    for key in KEYS:
        value = result[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), key
        assert value > 0, key
    assert "iperf_gbps" in result  # null where iperf3 is not installed
    assert result["size_bytes"] == 1 << 20
    assert result["iters"] == 1
    assert result["loop"] in ("uvloop", "asyncio")
    assert isinstance(result["pinned"], bool)
