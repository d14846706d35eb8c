"""The transfer benchmark runs end to end on tiny sizes and reports every number (never timings)."""

from __future__ import annotations

import json

import pytest

from tensorwire import _extensions
from tensorwire.bench.fastpaths import iperf_report_gbps
from tensorwire.bench.transfer import main

KEYS = [
    "put_gbps",
    "get_gbps",
    "socket_gbps",
    "put_ratio",
    "get_ratio",
    "small_get_us",
    "sync_small_get_us",
    "small_get_cpu_us",
    "small_get_client_cpu_us",
    "small_get_server_cpu_us",
    "small_echo_cpu_us",
    "small_cpu_vs_echo",
    "echo_us",
    "small_ratio",
    "small_unspun_get_us",
    "small_unspun_echo_us",
    "small_unspun_ratio",
    "many_small_per_s",
    "many_get_per_s",
    "tls_put_gbps",
    "tls_get_gbps",
    "tls_put_ratio",
    "tls_get_ratio",
    "tls_aead_gbps",
    "tls_aead_cryptography_gbps",
    "tls_bound_put_gbps",
    "tls_bound_get_gbps",
    "tls_put_vs_bound",
    "tls_get_vs_bound",
    "tls_vs_bound",
    "tls_ssl_loop_put_gbps",
    "tls_ssl_loop_get_gbps",
    "tls_vs_ssl_loop",
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
    ratio = result["small_get_cpu_us"] / result["small_echo_cpu_us"]
    assert result["small_cpu_vs_echo"] == pytest.approx(ratio)
    assert "iperf_gbps" in result  # null where iperf3 is not installed, with the reason
    assert isinstance(result["iperf_note"], str)
    assert isinstance(result["tls_aead_library"], str)  # which libcrypto tls://'s bound was measured with
    if result["iperf_gbps"] is not None:
        assert result["put_vs_iperf"] and result["get_vs_iperf"]
    else:
        assert result["put_vs_iperf"] is None and result["get_vs_iperf"] is None
    assert result["size_bytes"] == 1 << 20
    assert result["iters"] == 1
    assert result["loop"] in ("uvloop", "asyncio")
    # which twin ran (tensorwire._extensions): the compiled one unless this run refused it
    assert result["hot_path"] == ("pure" if _extensions.disabled() else "compiled")
    assert isinstance(result["pinned"], bool)


def test_an_iperf_report_without_sum_received_falls_back_to_sum_sent() -> None:
    # Seen once: iperf3 exited 0 with a report whose "end" had no "sum_received".
    sent = {"end": {"sum_sent": {"bits_per_second": 8e9}}}
    assert iperf_report_gbps(json.dumps(sent)) == (1.0, "iperf3 one stream, end.sum_sent")
    received = {"end": {"sum_received": {"bits_per_second": 16e9}, "sum_sent": {"bits_per_second": 8e9}}}
    assert iperf_report_gbps(json.dumps(received)) == (2.0, "iperf3 one stream, end.sum_received")
    gbps, why = iperf_report_gbps(json.dumps({"end": {}, "error": "interrupted"}))
    assert gbps is None and "interrupted" in why
    assert iperf_report_gbps("not json") == (None, "iperf3's report is not JSON")
    odd = {"end": {"sum_received": [], "sum_sent": {"bits_per_second": 8e9}}}  # a field of another shape
    assert iperf_report_gbps(json.dumps(odd)) == (1.0, "iperf3 one stream, end.sum_sent")
