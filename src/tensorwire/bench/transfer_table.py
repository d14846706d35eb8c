"""The table ``tensorwire bench transfer`` prints (bench/transfer.py measures): each figure next
to its baseline, and the rows of the fast paths, shm://, rdma:// and the ping lag. A figure a run
could not measure reads "n/a"."""

from __future__ import annotations

from tensorwire.bench import pinglag
from tensorwire.bench import rdma as rdma_bench
from tensorwire.bench import shm as shm_bench
from tensorwire.bench.report import table, throughput_head

Result = dict[str, float | int | str | None]  # a run's figures (bench/transfer.py ``run``)


def _fmt(value: float | int | str | None, spec: str) -> str:
    return "n/a" if not isinstance(value, float | int) else format(value, spec)


def format_table(r: Result) -> str:
    """The results as a readable table (GB/s are 1e9 bytes per second)."""
    rows = [
        ("put", f"{_fmt(r['put_gbps'], '.3f')} GB/s", f"{_fmt(r['put_ratio'], '.2f')} x socket"),
        ("get(out=)", f"{_fmt(r['get_gbps'], '.3f')} GB/s", f"{_fmt(r['get_ratio'], '.2f')} x socket"),
        ("plain socket", f"{_fmt(r['socket_gbps'], '.3f')} GB/s", "baseline"),
        (
            "1 KiB get p50 (async)",
            f"{_fmt(r['small_get_us'], '.1f')} us",
            f"{_fmt(r['small_ratio'], '.2f')} x echo",
        ),
        (
            "1 KiB get p50 (async, busy_wait=0)",
            f"{_fmt(r['small_unspun_get_us'], '.1f')} us",
            f"{_fmt(r['small_unspun_ratio'], '.2f')} x echo",
        ),
        ("1 KiB get p50 (sync)", f"{_fmt(r['sync_small_get_us'], '.1f')} us", ""),
        (
            "1 KiB get CPU (client + server)",
            f"{_fmt(r['small_get_cpu_us'], '.1f')} us",
            f"{_fmt(r['small_get_client_cpu_us'], '.1f')} + {_fmt(r['small_get_server_cpu_us'], '.1f')}, "
            f"{_fmt(r['small_cpu_vs_echo'], '.2f')} x echo",
        ),
        (
            "1 KiB echo CPU (client + server)",
            f"{_fmt(r['small_echo_cpu_us'], '.1f')} us",
            "floor: a blocking socket",
        ),
        ("1 KiB asyncio echo p50", f"{_fmt(r['echo_us'], '.1f')} us", "baseline"),
        (f"put_many {r['many']} x 1 KiB", f"{_fmt(r['many_small_per_s'], ',.0f')} tensors/s", ""),
        (f"get_many {r['many']} x 1 KiB", f"{_fmt(r['many_get_per_s'], ',.0f')} tensors/s", ""),
    ]
    rows += _tls_rows(r)
    rows += _fast_rows(r)
    rows += shm_bench.rows(r, _fmt)
    rows += rdma_bench.rows(r, _fmt)
    rows += pinglag.rows(r, _fmt)
    return table(throughput_head("transfer", r, f"loop {r['loop']}"), rows, value_width=22)


def _tls_rows(r: Result) -> list[tuple[str, str, str]]:
    """tls:// against tcp://, its AEAD bound and the plain ssl stream (bench/tls_bound.py, tls_loop.py)."""
    return [
        (
            "put over tls://",
            f"{_fmt(r['tls_put_gbps'], '.3f')} GB/s",
            f"{_fmt(r['tls_put_ratio'], '.2f')} x tcp://, {_fmt(r['tls_put_vs_bound'], '.2f')} x its bound "
            f"({_fmt(r['tls_bound_put_gbps'], '.3f')} GB/s; target 0.8x)",
        ),
        (
            "get over tls://",
            f"{_fmt(r['tls_get_gbps'], '.3f')} GB/s",
            f"{_fmt(r['tls_get_ratio'], '.2f')} x tcp://, {_fmt(r['tls_get_vs_bound'], '.2f')} x its bound "
            f"({_fmt(r['tls_bound_get_gbps'], '.3f')} GB/s; target 0.8x)",
        ),
        (
            "AES-256-GCM, one core",
            f"{_fmt(r['tls_aead_gbps'], '.3f')} GB/s",
            "the ssl module's libcrypto; in series with tcp://: tls://'s bound "
            f"(the cryptography package's: {_fmt(r['tls_aead_cryptography_gbps'], '.3f')} GB/s)",
        ),
        (
            "blocking ssl loop put / get",
            f"{_fmt(r['tls_ssl_loop_put_gbps'], '.3f')} / {_fmt(r['tls_ssl_loop_get_gbps'], '.3f')} GB/s",
            f"the ssl module alone; tls:// {_fmt(r['tls_vs_ssl_loop'], '.2f')} x it",
        ),
    ]


def _fast_rows(r: Result) -> list[tuple[str, str, str]]:
    """The rows of the fast paths (bench/fastpaths.py): striping, iperf3, compression, the cache."""
    return [
        (
            f"striped put+get ({r['stripes']} conns)",
            f"{_fmt(r['striped_gbps'], '.3f')} GB/s",
            f"{_fmt(r['striped_ratio'], '.2f')} x one stream ({_fmt(r['one_stream_gbps'], '.3f')})",
        ),
        ("iperf3 one stream", f"{_fmt(r['iperf_gbps'], '.3f')} GB/s", f"ceiling: {r['iperf_note']}"),
        (
            "put, get vs iperf3",
            f"{_fmt(r['put_vs_iperf'], '.2f')}, {_fmt(r['get_vs_iperf'], '.2f')} x",
            "the stable baseline (the plain socket swings 2x between runs)",
        ),
        (
            "lz4 put+get, sparse",
            f"{_fmt(r['lz4_gbps'], '.3f')} GB/s",
            f"{_fmt(r['lz4_ratio'], '.2f')} x raw ({_fmt(r['raw_compressible_gbps'], '.3f')})",
        ),
        (
            "zstd put+get, sparse",
            f"{_fmt(r['zstd_gbps'], '.3f')} GB/s",
            f"{_fmt(r['zstd_ratio'], '.2f')} x raw",
        ),
        (
            "auto put+get, random",
            f"{_fmt(r['auto_incompressible_gbps'], '.3f')} GB/s",
            f"{_fmt(r['auto_incompressible_ratio'], '.2f')} x raw (target >= 0.95)",
        ),
        ("cached 1 KiB get p50", f"{_fmt(r['cache_hit_get_us'], '.1f')} us", "one STAT"),
        ("leased 1 KiB get p50", f"{_fmt(r['cache_leased_get_us'], '.1f')} us", "no request"),
    ]
