"""`tensorwire bench all` end to end on tiny settings, and the report's table from results."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from tensorwire.bench import BENCHMARKS, report
from tensorwire.bench.all import main

PNG = b"\x89PNG\r\n\x1a\n"


def test_every_benchmark_of_the_table_is_a_module_with_main() -> None:
    for name in BENCHMARKS:
        assert callable(importlib.import_module(f"tensorwire.bench.{name}").main), name


def test_bench_all_quick_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = main(["--quick", "--only", "sweep", "--out", str(tmp_path)])

    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["machine"]["cpus"] >= 1 and saved["machine"]["memory_bytes"] > 0
    assert saved["machine"]["torch"] and saved["machine"]["python"]
    sweep = doc["benchmarks"]["sweep"]
    assert sweep["error"] is None, sweep["error"]
    result = sweep["result"]
    assert result["sizes"][0] == 4096 and len(result["gbps"]["tcp put"]) == len(result["sizes"])
    for name in ("tcp put", "tcp get", "socket send", "memcpy"):
        assert all(v > 0 for v in result["gbps"][name]), name
    assert 0 < result["latency_us"]["tcp"]["p50"] <= result["latency_us"]["tcp"]["p99"]
    assert result["cpu_s_per_gb"]["tcp"]["client"] >= 0 and result["cpu_s_per_gb"]["tcp"]["server"] >= 0
    assert result["peak_rss_bytes"]["tcp"]["server"] > 10 << 20  # a real process's high-water mark
    assert doc["benchmarks"]["transfer"]["args"] is None  # not in --only
    text = (tmp_path / "report.md").read_text()
    assert "| benchmark | path | figure | ceiling or peer (same run) | ratio |" in text
    assert "| sweep | tcp put 64 KiB |" in text and "![summary](summary.png)" in text
    for name in [*report.PLOTS, report.SUMMARY_PLOT]:
        assert (tmp_path / name).read_bytes()[:8] == PNG, name
    assert (tmp_path / "logs" / "sweep.log").read_text().strip()
    assert "| sweep |" in capsys.readouterr().out


def test_report_rows_pair_each_figure_with_its_peer() -> None:
    doc = {
        "benchmarks": {
            "transfer": {"result": {"put_gbps": 2.0, "get_gbps": 1.0, "socket_gbps": 4.0, "tls_put_gbps": 1.0,
                                    "small_get_us": 90.0, "echo_us": 60.0, "small_unspun_get_us": 120.0,
                                    "small_unspun_echo_us": 80.0, "size_bytes": 1 << 20, "many": 10,
                                    "many_small_per_s": 5.0, "shm_get_gbps": 9.0, "memcpy_gbps": 10.0}},
            "ps": {"result": {"ps_async_samples_per_s": 300.0, "rpc_ps_samples_per_s": 100.0,
                              "ps_sync_samples_per_s": 90.0, "ddp_samples_per_s": 100.0}},
            "grpc": {"result": None, "error": "Traceback ...\nRuntimeError: no port"},
            "newbench": {"result": {"topk_ratio": 0.01, "int8_vs_fp32": 0.25, "seconds": 3.0}},
        }
    }  # fmt: skip
    by_path = {(r.benchmark, r.path, r.peer): r for r in report.rows(doc)}
    assert by_path[("transfer", "tcp put 1 MiB", "plain socket")].ratio == 0.5
    latency = by_path[("transfer", "1 KiB get p50 (asyncio client)", "asyncio echo")]
    assert latency.ratio == 1.5 and latency.lower_is_better
    assert by_path[("transfer", "1 KiB get p50 (asyncio, busy_wait=0)", "asyncio echo")].ratio == 1.5
    assert by_path[("ps", "PS async, 2 servers", "torch.distributed.rpc PS")].ratio == 3.0
    assert by_path[("transfer", "shm get(out=) 1 MiB", "memcpy")].ratio == 0.9
    assert not any(p.startswith("striped") for _, p, _ in by_path)  # fields it lacks: no rows
    # a benchmark the report has no rows for (a new module in the table) still shows its ratios
    assert {p for b, p, _ in by_path if b == "newbench"} == {"topk_ratio", "int8_vs_fp32"}
    doc["machine"] = {"cpus": 2, "cpu_model": "x", "memory_bytes": 1 << 30, "load_average": [1.0, 1.0, 1.0],
                      "python": "3.11", "torch": "2", "tensorwire": "0.1.0"}  # fmt: skip
    doc.update(started="now", seconds=1.0, quick=False)
    text = report.markdown(doc, [])
    assert "| transfer | tcp put 1 MiB | 2 GB/s | plain socket: 4 GB/s | 0.50x |" in text
    assert "- grpc: RuntimeError: no port" in text


def test_report_rows_of_the_peers_and_of_iperf3() -> None:
    peers = {
        "ray_size_bytes": 16 << 20,
        "size_bytes": 256 << 20,
        "many": 10,
        "tw_shm_put_gbps": 10.0,
        "ray_put_gbps": 0.5,
        "tw_tcp_small_get_us": 100.0,
        "mooncake_read_us": 50.0,
        "tw_tcp_bulk_put_gbps": 2.0,
        "gloo_send_gbps": None,
    }
    transfer = {"put_gbps": 2.0, "get_gbps": 3.0, "iperf_gbps": 4.0, "size_bytes": 1 << 20}
    doc = {"benchmarks": {"peers": {"result": peers}, "transfer": {"result": transfer}}}  # fmt: skip
    by_path = {(r.benchmark, r.path, r.peer): r for r in report.rows(doc)}
    assert by_path[("peers", "shm put 16 MiB", "ray.put")].ratio == 20.0
    assert by_path[("peers", "tcp 1 KiB get p50", "Mooncake 1 KiB read")].ratio == 2.0
    assert ("peers", "tcp put 256 MiB", "gloo send") not in by_path  # not measured: no row
    assert by_path[("transfer", "tcp get(out=) 1 MiB vs iperf3", "iperf3 one stream")].ratio == 0.75
