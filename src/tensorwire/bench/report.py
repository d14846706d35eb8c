"""The benchmark report: ``report.json``, ``report.md`` (one table) and PNG plots.

``report.md``'s table has one row per path measured: its figure, the ceiling or peer measured in
the same run, and the ratio of the two (for latencies and costs, lower is better, and the table
says so). Each benchmark's rows come from a function in ``ROWS``; a benchmark without one (a new
module in ``tensorwire.bench.BENCHMARKS``) still gets a row for each of its ``*ratio*`` and
``*_vs_*`` figures. The plots come from the sweep benchmark (``sweep.py``): bandwidth by tensor
size for each transport and peer, latency percentiles, CPU seconds per GB and peak RSS.

A benchmark run alone prints its own result with ``show``: one JSON line with ``--json``, else its
readable form (``table`` lays out the name, value and note columns most of them use).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tensorwire.types import KiB, MiB

PLOTS = ("bandwidth.png", "latency.png", "cpu.png", "rss.png")
SUMMARY_PLOT = "summary.png"  # the four in one figure (the README shows it)
R = TypeVar("R")


@dataclass(frozen=True)
class Row:
    benchmark: str
    path: str
    figure: float | None
    unit: str
    peer: str = ""
    peer_figure: float | None = None
    lower_is_better: bool = False

    @property
    def ratio(self) -> float | None:
        if self.figure is None or not self.peer_figure:
            return None
        return self.figure / self.peer_figure

    def cells(self) -> list[str]:
        better = " (lower is better)" if self.lower_is_better else ""
        ratio = "" if self.ratio is None else f"{self.ratio:.2f}x{better}"
        peer = f"{self.peer}: {_num(self.peer_figure)} {self.unit}" if self.peer else ""
        return [self.benchmark, self.path, f"{_num(self.figure)} {self.unit}", peer, ratio]


def _num(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def _get(r: dict[str, Any], key: str) -> float | None:
    value = r.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


# -- rows of each benchmark -------------------------------------------------------------------------
def _transfer(r: dict[str, Any]) -> list[Row]:
    size, socket = f"{int(r.get('size_bytes', 0)) // MiB} MiB", _get(r, "socket_gbps")
    return [
        Row("transfer", f"tcp put {size}", _get(r, "put_gbps"), "GB/s", "plain socket", socket),
        Row("transfer", f"tcp get(out=) {size}", _get(r, "get_gbps"), "GB/s", "plain socket", socket),
        Row("transfer", f"tls put {size}", _get(r, "tls_put_gbps"), "GB/s", "tcp put", _get(r, "put_gbps")),
        Row("transfer", "1 KiB get p50 (asyncio client)", _get(r, "small_get_us"), "us", "asyncio echo",
            _get(r, "echo_us"), lower_is_better=True),
        Row("transfer", "1 KiB get p50 (asyncio, busy_wait=0)", _get(r, "small_unspun_get_us"), "us",
            "asyncio echo", _get(r, "small_unspun_echo_us"), lower_is_better=True),
        Row("transfer", f"put_many of {r.get('many')} x 1 KiB", _get(r, "many_small_per_s"), "tensors/s"),
        Row("transfer", f"1 KiB get p99 during a {int(r.get('ping_put_bytes', 0)) // MiB} MiB put",
            _get(r, "ping_during_put_p99_ms"), "ms", "idle", _get(r, "ping_idle_p99_ms"),
            lower_is_better=True),
        *_fast_paths(r, size),
    ]  # fmt: skip


def _fast_paths(r: dict[str, Any], size: str) -> list[Row]:
    """shm://, striping, lossless compression and the client cache (absent fields: no rows)."""
    memcpy, raw = _get(r, "memcpy_gbps"), _get(r, "raw_compressible_gbps")
    rows = [
        Row("transfer", f"shm put {size}", _get(r, "shm_put_gbps"), "GB/s", "memcpy", memcpy),
        Row("transfer", f"shm get(out=) {size}", _get(r, "shm_get_gbps"), "GB/s", "memcpy", memcpy),
        Row(
            "transfer",
            f"striped tcp put ({r.get('stripes')} lanes)",
            _get(r, "striped_gbps"),
            "GB/s",
            "one stream",
            _get(r, "one_stream_gbps"),
        ),
        Row("transfer", "lz4 put, sparse tensor", _get(r, "lz4_gbps"), "GB/s", "raw", raw),
        Row("transfer", "zstd put, sparse tensor", _get(r, "zstd_gbps"), "GB/s", "raw", raw),
        Row(
            "transfer",
            "auto compression put, random floats",
            _get(r, "auto_incompressible_gbps"),
            "GB/s",
            "raw",
            _get(r, "raw_incompressible_gbps"),
        ),
        Row(
            "transfer",
            "cache hit get (one STAT)",
            _get(r, "cache_hit_get_us"),
            "us",
            "cache miss",
            _get(r, "cache_miss_get_us"),
            lower_is_better=True,
        ),
        Row("transfer", "iperf3 (loopback)", _get(r, "iperf_gbps"), "GB/s"),
        Row("transfer", f"tcp put {size} vs iperf3 (the stable baseline)", _get(r, "put_gbps"), "GB/s",
            "iperf3 one stream", _get(r, "iperf_gbps")),
        Row("transfer", f"tcp get(out=) {size} vs iperf3", _get(r, "get_gbps"), "GB/s",
            "iperf3 one stream", _get(r, "iperf_gbps")),
    ]  # fmt: skip
    return [row for row in rows if row.figure is not None]


def _compression(r: dict[str, Any]) -> list[Row]:
    base = _get(r, "baseline_accuracy")
    rows = []
    for name, c in r.get("codecs", {}).items():
        rows.append(Row("compression", f"{name}: bytes on the wire", _get(c, "compression"), "x fewer"))
        rows.append(Row("compression", f"{name}: accuracy, error feedback", _get(c, "accuracy_ef"), "",
                        "fp32", base))  # fmt: skip
        decode = _num(_get(c, "decode_gbps"))
        rows.append(Row("compression", f"{name}: encode (decode: {decode} GB/s)", _get(c, "encode_gbps"),
                        "GB/s", "target", 1.0))  # fmt: skip
    return rows


def _grpc(r: dict[str, Any]) -> list[Row]:
    size = f"{int(r.get('size_bytes', 0)) // MiB} MiB"
    rows = []
    for op, verb in (("put", "do_put"), ("get", "do_get")):
        ours, path = _get(r, f"grpc_{op}_gbps"), f"grpc {op} {size}"
        rows.append(Row("grpc", path, ours, "GB/s", f"Arrow Flight {verb}", _get(r, f"flight_{op}_gbps")))
        rows.append(Row("grpc", path, ours, "GB/s", "naive unary gRPC", _get(r, f"naive_{op}_gbps")))
    return rows


def _ps(r: dict[str, Any]) -> list[Row]:
    return [
        Row("ps", "PS async, 2 servers", _get(r, "ps_async_samples_per_s"), "samples/s",
            "torch.distributed.rpc PS", _get(r, "rpc_ps_samples_per_s")),
        Row("ps", "PS sync, 2 servers", _get(r, "ps_sync_samples_per_s"), "samples/s",
            "DDP over gloo", _get(r, "ddp_samples_per_s")),
    ]  # fmt: skip


def _chaos(r: dict[str, Any]) -> list[Row]:
    faults = r.get("faults_injected")
    return [
        Row("chaos", f"training throughput, {faults} processes killed", _get(r, "throughput_ratio"),
            "x calm", "the same job without faults", 1.0),
        Row("chaos", "failover p50 (kill to next step)", _get(r, "failover_p50_s"), "s"),
        Row("chaos", "updates lost / applied twice",
            _get(r, "lost_updates"), f"lost ({r.get('duplicate_updates')} twice)"),
    ]  # fmt: skip


def _sweep(r: dict[str, Any]) -> list[Row]:
    gbps, sizes = r["gbps"], r["sizes"]
    top = f"{_size(sizes[-1])}"
    socket, memcpy = gbps["socket send"][-1], gbps["memcpy"][-1]
    rows = []
    for t in r["transports"]:
        peer, peer_figure = ("memcpy", memcpy) if t == "memory" else ("plain socket", socket)
        for op in ("put", "get"):
            rows.append(Row("sweep", f"{t} {op} {top}", gbps[f"{t} {op}"][-1], "GB/s", peer, peer_figure))
        p50, echo = r["latency_us"][t]["p50"], r["latency_us"]["socket echo"]["p50"]
        rows.append(Row("sweep", f"{t} 4 KiB get p50", p50, "us", "socket echo", echo, lower_is_better=True))
        rows.append(Row("sweep", f"{t} CPU per GB (client + server)", _cpu(r, t), "CPU s/GB", "plain socket",
                        _cpu(r, "socket"), lower_is_better=True))  # fmt: skip
        rss = r["peak_rss_bytes"][t]
        if rss["server"] is None:  # memory://: one process
            rows.append(Row("sweep", f"{t} peak RSS (one process)", rss["client"] / MiB, "MiB"))
        else:
            rows.append(Row("sweep", f"{t} server peak RSS", rss["server"] / MiB, "MiB"))
    return rows


def _reshard(r: dict[str, Any]) -> list[Row]:
    size = f"{int(r.get('size_bytes', 0)) // MiB} MiB"
    return [
        Row("reshard", f"{size} 4 ranks -> 2 (Shard(0) -> Shard(1)) and back", _get(r, "tw_s"), "s",
            "torch.distributed.checkpoint, /dev/shm", _get(r, "dcp_s"), lower_is_better=True),
        Row("reshard", "bytes moved", _get(r, "bytes_moved"), "B", "the layouts' overlap",
            _get(r, "overlap_bytes"), lower_is_better=True),
        Row("reshard", "async save: the training step waits", _get(r, "async_blocked_s"), "s",
            "synchronous put", _get(r, "sync_put_s"), lower_is_better=True),
        Row("reshard", f"DCP save + load {size} 4 ranks -> 2 through tensorwire.dcp",
            _dcp_tw(r), "s", "DCP's own files, /dev/shm", _get(r, "dcp_tmpfs_s"), lower_is_better=True),
    ]  # fmt: skip


def _dcp_tw(r: dict[str, Any]) -> float | None:
    save, load = _get(r, "dcp_tw_save_s"), _get(r, "dcp_tw_load_s")
    return None if save is None or load is None else save + load


def _peers(r: dict[str, Any]) -> list[Row]:
    """Each peer next to tensorwire doing the same (absent peers: no rows)."""
    ray, bulk = _size(int(r.get("ray_size_bytes") or 0)), _size(int(r.get("size_bytes") or 0))
    g = _get
    rows = [
        Row("peers", f"shm put {ray}", g(r, "tw_shm_put_gbps"), "GB/s", "ray.put", g(r, "ray_put_gbps")),
        Row("peers", f"shm get(out=) {ray}", g(r, "tw_shm_get_gbps"), "GB/s", "ray.get in an actor",
            g(r, "ray_get_gbps")),
        Row("peers", f"tcp put {ray}", g(r, "tw_tcp_put_gbps"), "GB/s", "ray.put", g(r, "ray_put_gbps")),
        Row("peers", "shm 1 KiB get p50", g(r, "tw_shm_get_us"), "us", "Ray 1 KiB actor call",
            g(r, "ray_call_us"), lower_is_better=True),
        Row("peers", "tcp 1 KiB get p50", g(r, "tw_tcp_get_us"), "us", "Ray 1 KiB actor call",
            g(r, "ray_call_us"), lower_is_better=True),
        Row("peers", f"shm put_many of {r.get('many')} x 1 KiB", g(r, "tw_shm_small_per_s"), "objects/s",
            "single ray.puts", g(r, "ray_small_per_s")),
        Row("peers", f"tcp put {bulk}", g(r, "tw_tcp_bulk_put_gbps"), "GB/s", "Mooncake TCP write",
            g(r, "mooncake_write_gbps")),
        Row("peers", f"tcp get(out=) {bulk}", g(r, "tw_tcp_bulk_get_gbps"), "GB/s", "Mooncake TCP read",
            g(r, "mooncake_read_gbps")),
        Row("peers", "tcp 1 KiB get p50", g(r, "tw_tcp_small_get_us"), "us", "Mooncake 1 KiB read",
            g(r, "mooncake_read_us"), lower_is_better=True),
        Row("peers", f"tcp put {bulk}", g(r, "tw_tcp_bulk_put_gbps"), "GB/s", "gloo send",
            g(r, "gloo_send_gbps")),
        Row("peers", "tcp 1 KiB get p50", g(r, "tw_tcp_small_get_us"), "us", "gloo 1 KiB ping-pong",
            g(r, "gloo_us"), lower_is_better=True),
    ]  # fmt: skip
    return [row for row in rows if row.figure is not None and row.peer_figure is not None]


def _cpu(r: dict[str, Any], name: str) -> float:
    c = r["cpu_s_per_gb"][name]
    return float(c["client"] + (c["server"] or 0.0))


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _generic(name: str, r: dict[str, Any]) -> list[Row]:
    """A benchmark without its own rows: each ratio it reports."""
    keys = [k for k in r if ("ratio" in k or "_vs_" in k) and _get(r, k) is not None]
    return [Row(name, k, _get(r, k), "x") for k in keys]


ROWS: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "transfer": _transfer,
    "grpc": _grpc,
    "ps": _ps,
    "chaos": _chaos,
    "compression": _compression,
    "sweep": _sweep,
    "reshard": _reshard,
    "peers": _peers,
}


def rows(doc: dict[str, Any]) -> list[Row]:
    table: list[Row] = []
    for name, run in doc["benchmarks"].items():
        result = run.get("result")
        if result:
            table.extend(ROWS[name](result) if name in ROWS else _generic(name, result))
    return table


# -- writing ---------------------------------------------------------------------------------------
def markdown(doc: dict[str, Any], plots: list[str]) -> str:
    m = doc["machine"]
    lines = [
        "# tensorwire benchmark report",
        "",
        f"{doc['started']}, {doc['seconds']:.0f} s in all{' (--quick)' if doc['quick'] else ''}. "
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_bytes'] / (1 << 30):.1f} GiB, "
        f"load average {m['load_average'][0]:.2f} at the start; Python {m['python']}, torch {m['torch']}, "
        f"tensorwire {m['tensorwire']}.",
        "",
        "Every ratio compares two figures measured in the same run: compare ratios between runs, "
        "not absolute numbers. GB/s are 1e9 bytes per second.",
        "",
        "| benchmark | path | figure | ceiling or peer (same run) | ratio |",
        "|---|---|---:|---|---:|",
    ]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows(doc)]
    notes = [f"- {name}: {run['error'].splitlines()[-1] if run.get('error') else 'skipped'}"
             for name, run in doc["benchmarks"].items() if not run.get("result")]  # fmt: skip
    if notes:
        lines += ["", "Not measured:", "", *notes]
    lines += ["", *[f"![{Path(p).stem}]({p})" for p in plots]]
    return "\n".join(lines) + "\n"


def write(out: Path, doc: dict[str, Any]) -> list[Path]:
    """Write report.json, the plots (when there is a sweep) and report.md into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    sweep = (doc["benchmarks"].get("sweep") or {}).get("result")
    plots = plot(sweep, out) if sweep else []
    (out / "report.md").write_text(markdown(doc, [p.name for p in plots]))
    return [out / "report.json", out / "report.md", *plots]


# -- plots -----------------------------------------------------------------------------------------
def plot(sweep: dict[str, Any], out: Path) -> list[Path]:
    """The sweep's four plots, each on its own and all four in ``summary.png``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    drawers = (_bandwidth, _latency, _cpu_plot, _rss)
    written = []
    for name, draw in zip(PLOTS, drawers, strict=True):
        fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
        draw(ax, sweep)
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5), layout="constrained")
    for ax, draw in zip(axes.flat, drawers, strict=True):
        draw(ax, sweep)
    fig.suptitle("tensorwire: transports and peers measured in one run (tensorwire bench all)")
    fig.savefig(out / SUMMARY_PLOT, dpi=90)
    plt.close(fig)
    return [*written, out / SUMMARY_PLOT]


def _bandwidth(ax: Any, s: dict[str, Any]) -> None:
    for name, series in s["gbps"].items():
        peer = name in ("socket send", "memcpy")
        ax.plot(s["sizes"], series, marker="o", markersize=3, linestyle="--" if peer else "-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(s["sizes"], [_size(n) for n in s["sizes"]], rotation=45, fontsize=7)
    ax.set_xlabel("tensor size")
    ax.set_ylabel("GB/s (1e9 bytes/s)")
    ax.set_title("bandwidth by tensor size (dashed: peers)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)


def _latency(ax: Any, s: dict[str, Any]) -> None:
    names = list(s["latency_us"])
    width = 0.27
    for i, q in enumerate(("p50", "p90", "p99")):
        xs = [j + (i - 1) * width for j in range(len(names))]
        ax.bar(xs, [s["latency_us"][n][q] for n in names], width, label=q)
    ax.set_xticks(range(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("microseconds")
    ax.set_title(f"{s['latency_bytes'] // KiB} KiB get latency (socket: echo)")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)


def _cpu_plot(ax: Any, s: dict[str, Any]) -> None:
    names = list(s["cpu_s_per_gb"])
    client = [s["cpu_s_per_gb"][n]["client"] for n in names]
    server = [s["cpu_s_per_gb"][n]["server"] or 0.0 for n in names]
    ax.bar(names, client, label="client process")
    ax.bar(names, server, bottom=client, label="server process")
    ax.set_ylabel("CPU seconds per GB moved")
    ax.set_title(f"CPU per GB, {_size(s['cpu_bytes'])} puts + gets (memory: one process)")
    ax.legend(fontsize=8)


def _rss(ax: Any, s: dict[str, Any]) -> None:
    names = list(s["peak_rss_bytes"])
    width = 0.4
    for i, side in enumerate(("client", "server")):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        ax.bar(xs, [(s["peak_rss_bytes"][n][side] or 0) / MiB for n in names], width, label=f"{side} process")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("MiB")
    ax.set_title("peak resident memory, VmHWM (memory: one process)")
    ax.legend(fontsize=8)


__all__ = ["PLOTS", "ROWS", "SUMMARY_PLOT", "Row", "markdown", "plot", "rows", "write"]


# -- one benchmark's own printout -------------------------------------------------------------------
def show(result: R, as_json: bool, readable: Callable[[R], str | None]) -> R:
    """Print ``result`` as one JSON line (``--json``: what ``bench all`` and scripts read), else
    ``readable(result)`` (a text to print, or None where it printed itself, as a rich table does).
    Returns ``result``, for ``main`` to return."""
    text = json.dumps(result) if as_json else readable(result)
    if text is not None:
        print(text, flush=True)
    return result


def throughput_head(benchmark: str, r: Mapping[str, object], *details: str) -> str:
    """The heading of a bulk-throughput table: the size moved, how the figure was taken, where."""
    size = r["size_bytes"]
    mib = size / MiB if isinstance(size, int) else 0.0
    where = ", ".join([*details, "pinned" if r["pinned"] else "unpinned"])
    return (
        f"tensorwire {benchmark} benchmark: {mib:g} MiB float32, median of {r['iters']} (after warm-up), "
        f"{where}; GB/s = 1e9 bytes/s"
    )


def table(head: str, rows: Sequence[tuple[str, str, str]], value_width: int) -> str:
    """A benchmark's readable report: a heading, then name, value and note in aligned columns."""
    width = max(len(name) for name, _, _ in rows)
    lines = [f"  {name:<{width}}  {value:>{value_width}}  {note}".rstrip() for name, value, note in rows]
    return "\n".join([head, *lines])
