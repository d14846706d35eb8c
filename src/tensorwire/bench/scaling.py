"""Bytes moved per step by the parameter server, as a model and as measured (docs/explanation/scaling.md).

The model (``traffic`` and ``step_time``): a job of P parameters on S servers (each a primary with
R backups) and W workers, synchronous, whose pushes carry ``push`` bytes per element (the worker's
``push_codec``: none sends the gradient's dtype, fp32 4; fp16/bf16 2; int8 1 + 4/4096; ...) and
whose pulls carry ``pull`` bytes per element (the ``pull_codec``: none sends fp32, 4; int8, bf16 or
fp16 less). ``CODECS`` takes those sizes from ``tensorwire.compression`` itself, so the model
cannot drift from what the codecs put on the wire:

- each worker sends P*push and receives P*pull per step;
- each primary receives W*P*push/S, sends W*P*pull/S to workers and R*W*P*push/S to its backups
  (a primary forwards each push's gradient bytes to every backup before it answers);
- a sync step is a push phase then a pull phase, each as long as its busiest link:
  push = max(P*push/B, max(W, R*W + 1)*P*push/(S*B)) (W instead of max(..) without backups: a
  primary forwards each push to its R backups while the next arrives, starting once the first is
  in), pull = max(P*pull/B, W*P*pull/(S*B)), for links of B bytes/s each way (full duplex), plus
  compute.

The measurement puts every server and worker process in a network namespace of its own, each
joined to a bridge by a veth link shaped to ``--rate`` (tc tbf, both directions), trains an MLP of
~``--params`` parameters for ``--steps`` sync steps, and reads each link's byte counters
(/sys/class/net/<veth>/statistics) around those steps. Skipped, with the reason, where namespaces
cannot be made. ``python -m tensorwire.bench.scaling --json`` (< 2 minutes); ``--table`` prints
the model's table for docs/explanation/scaling.md (``--pull int8`` with quantised pulls).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tensorwire._fs import write_file
from tensorwire.bench.netns import Fabric, Unavailable
from tensorwire.compression.codecs import codec_for
from tensorwire.ps.launch import replica_flags, stop_all
from tensorwire.security import write_token_file
from tensorwire.server.process import ServerProcess, run_threads, wait_for

# A parameter shard of this many elements (4 MiB of fp32) is what one codec payload covers: the
# per-payload parts (int8's scale per 4096 elements, sign's one scale) are spread over it.
SHARD_ELEMENTS = 1 << 20
# Each gradient codec of the table (its label says what travels) and its wire name.
CODEC_NAMES: dict[str, str] = {
    "fp32": "fp32",  # no codec: the gradient in its own dtype
    "fp16/bf16": "fp16",
    "int8 (+fp32 scale per 4096)": "int8",
    "topk 1% (int32 index + fp32 value)": "topk:0.01",
    "topk 1% + fp16 values": "topk:0.01+fp16",
    "sign (+one fp32 scale per shard)": "sign",
}


def bytes_per_element(codec: str, elements: int = SHARD_ELEMENTS) -> float:
    """What ``codec`` (a wire name) puts on the wire per element of a shard of ``elements``."""
    return codec_for(codec).payload_bytes(elements) / elements


# Bytes per element on the wire for each gradient codec (what a push carries), from the codecs.
CODECS: dict[str, float] = {label: bytes_per_element(name) for label, name in CODEC_NAMES.items()}
PORT = 7070  # each server has a namespace, so an address, of its own
TCP_OVERHEAD = 66 / 1448  # Ethernet + IP + TCP (timestamps) headers per full 1500-byte frame


@dataclass(frozen=True, slots=True)
class Job:
    params: int
    servers: int
    workers: int
    replicas: int = 0
    push: float = 4.0  # bytes per element of a gradient push
    pull: float = 4.0  # bytes per element of a parameter pull


def traffic(job: Job) -> dict[str, float]:
    """Payload bytes per sync step on each kind of link (one worker, one primary, one backup)."""
    p, s, w, r = job.params, job.servers, job.workers, job.replicas
    return {
        "worker_sent": p * job.push,
        "worker_received": p * job.pull,
        "server_received": w * p * job.push / s,
        "server_sent": w * p * job.pull / s + r * w * p * job.push / s,
        "backup_received": w * p * job.push / s if r else 0.0,
        "network_total": w * p * (job.push + job.pull) + r * w * p * job.push,
    }


def step_time(job: Job, link_bytes_per_s: float, compute_s: float = 0.0) -> dict[str, Any]:
    """Seconds a sync step spends on the network (push phase + pull phase), and which link bounds it."""
    p, s, w, r, b = job.params, job.servers, job.workers, job.replicas, link_bytes_per_s
    # A primary forwards each push to its R backups while the next one arrives (full duplex): its
    # out link carries R*W shards, starting once the first one is in.
    shards_in_push = max(w, r * w + 1) if r else w
    push_worker, push_server = p * job.push / b, shards_in_push * p * job.push / (s * b)
    pull_worker, pull_server = p * job.pull / b, w * p * job.pull / (s * b)
    push, pull = max(push_worker, push_server), max(pull_worker, pull_server)
    bound = "server NIC" if push_server + pull_server > push_worker + pull_worker else "worker NIC"
    return {"push_s": push, "pull_s": pull, "step_s": compute_s + push + pull, "bound": bound}


def markdown_table(params: int, workers: int, gbits: float, pull: float = 4.0) -> str:
    """The model's step times for a grid of servers, replicas and push codecs, with pulls of
    ``pull`` bytes per element (docs/explanation/scaling.md)."""
    rate = gbits * 1e9 / 8
    rows = [f"| codec (push) | B/elem | S | R | worker sends/step | server sends/step | network/step "
            f"| comm s/step @ {gbits:g} Gb/s | bound |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for codec, per in CODECS.items():
        for servers, replicas in ((1, 0), (4, 0), (16, 0), (4, 1)):
            job = Job(params, servers, workers, replicas, push=per, pull=pull)
            t, st = traffic(job), step_time(job, rate)
            rows.append(f"| {codec} | {per:.3g} | {servers} | {replicas} | {_mb(t['worker_sent'])} "
                        f"| {_mb(t['server_sent'])} | {_mb(t['network_total'])} | {st['step_s']:.3f} "
                        f"| {st['bound']} |")  # fmt: skip
    return "\n".join(rows)


def measured_markdown(runs: Sequence[dict[str, Any]]) -> str:
    """The measured runs of ``main`` as the markdown table of docs/explanation/scaling.md."""
    head = (
        "| S | R | W | link | model MB/step | measured MB/step | wire/model | step s model | step s measured "
    )
    rows = [head + "| measured/model |", "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        job, model, wire = run["job"], run["model"], run["measured_wire"]
        links = ["worker_sent", "worker_received", "server_received", "server_sent"]
        links += ["backup_received"] if job["replicas"] else []
        for i, key in enumerate(links):
            lead = f"| {job['servers']} | {job['replicas']} | {job['workers']} " if i == 0 else "| | | "
            step = (f"{run['model_step_s']:.3f} | {run['step_s']:.3f} | {run['step_over_model']:.2f}"
                    if i == 0 and run["model_step_s"] else " | | ")  # fmt: skip
            rows.append(f"{lead}| {key.replace('_', ' ')} | {model[key] / 1e6:.2f} | {wire[key] / 1e6:.2f} "
                        f"| {run['wire_over_model'][key]:.4f} | {step} |")  # fmt: skip
    return "\n".join(rows)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


# -- the measurement --------------------------------------------------------------------------------
def mlp(params: int) -> torch.nn.Module:
    """Two linear layers of about ``params`` parameters (hidden width h: 2 * 512 * h)."""
    hidden = max(8, params // 1024)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 512))


def worker_main(rank: int, world: int, servers: str, *, steps: int, params: int, folder: Path) -> None:
    """One worker (run inside its namespace): warm up, wait for the go, time ``steps`` sync steps."""
    from tensorwire.ps import SGD, Worker

    torch.set_num_threads(1)
    net = mlp(params)
    x, y = torch.randn(32, 512), torch.randn(32, 512)
    with Worker(net, servers, "sync", SGD(lr=1e-3), rank=rank, world_size=world, timeout=60) as worker:
        for _ in range(2):  # the job's creation and first pulls are not part of a step
            torch.nn.functional.mse_loss(net(x), y).backward()  # type: ignore[no-untyped-call]
            worker.step()
        pushed, pulled = worker.bytes_pushed, worker.bytes_pulled
        (folder / f"ready-{rank}").touch()
        wait_for((folder / "go").exists, 120, "the go signal")
        compute = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            torch.nn.functional.mse_loss(net(x), y).backward()  # type: ignore[no-untyped-call]
            compute += time.perf_counter() - t0
            worker.step()
        elapsed = time.perf_counter() - start
        result = {"step_s": elapsed / steps, "compute_s": compute / steps,
                  "app_sent": (worker.bytes_pushed - pushed) / steps,
                  "app_received": (worker.bytes_pulled - pulled) / steps}  # fmt: skip
        # Whole or absent: the harness reads it as soon as it exists (an empty file was read once).
        report = json.dumps(result).encode()
        write_file(folder / f"worker-{rank}.json", lambda f: f.write(report))
        wait_for((folder / "exit").exists, 120, "the exit signal")  # leave after the counters are read


def measure(job: Job, steps: int, rate_bits: int | None) -> dict[str, Any]:
    """Run ``job`` across namespaces; per-step bytes on each link and the step time."""
    slots = job.servers * (1 + job.replicas)
    with Fabric(slots + job.workers, rate_bits) as fabric, tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        urls = [f"tcp://{fabric.addresses[i]}:{PORT}" for i in range(slots)]
        servers: list[ServerProcess | None] = [None] * slots
        try:
            _start_servers(job, urls, fabric, servers, folder)
            size = 1 + job.replicas
            replica_sets = ",".join("|".join(urls[i : i + size]) for i in range(0, slots, size))
            procs = [
                _start_worker(
                    r,
                    job,
                    servers=replica_sets,
                    steps=steps,
                    folder=folder,
                    wrapper=fabric.wrapper(slots + r),
                )
                for r in range(job.workers)
            ]
            try:
                return _run_steps(job, steps, folder=folder, fabric=fabric, slots=slots, procs=procs)
            finally:
                (folder / "exit").touch()
                for proc in procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(30)
                stop_all(procs)
        finally:
            for server in servers:
                if server is not None:
                    server.stop()


def _start_servers(
    job: Job, urls: list[str], fabric: Fabric, servers: list[ServerProcess | None], folder: Path
) -> None:
    """Every backup, then every primary (a primary sends to its backups from the start), each
    phase in parallel: a server's start is mostly importing torch. The replicas of a slot share
    a peer token (in ``folder``)."""
    size = 1 + job.replicas
    slots = range(len(urls) // size) if job.replicas else range(0)
    tokens = [write_token_file(folder / f"slot{i}.token") for i in slots]
    for phase in ([i for i in range(len(urls)) if i % size], list(range(0, len(urls), size))):
        if not phase:
            continue

        def start(k: int, phase: list[int] = phase) -> None:
            i = phase[k]
            slot = urls[i - i % size : i - i % size + size]
            flags = replica_flags(slot, i % size, tokens[i // size]) if job.replicas else []
            servers[i] = ServerProcess(urls[i], capacity="2GiB", extra=flags, wrapper=fabric.wrapper(i),
                                       start_timeout=90)  # fmt: skip

        run_threads(start, len(phase), 180)


def _start_worker(
    rank: int, job: Job, *, servers: str, steps: int, folder: Path, wrapper: list[str]
) -> subprocess.Popen[bytes]:
    cmd = [*wrapper, sys.executable, "-m", "tensorwire.bench.scaling", "--worker", str(rank),
           str(job.workers), servers, str(steps), str(job.params), str(folder)]  # fmt: skip
    with open(folder / f"worker-{rank}.log", "wb") as log:  # a file: a pipe nobody reads can fill up
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def _run_steps(
    job: Job, steps: int, *, folder: Path, fabric: Fabric, slots: int, procs: list[subprocess.Popen[bytes]]
) -> dict[str, Any]:
    def all_there(prefix: str) -> bool:
        for rank, proc in enumerate(procs):
            if proc.poll() is not None:
                log = (folder / f"worker-{rank}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"worker {rank} exited with {proc.returncode}: {log}")
        suffix = ".json" if prefix == "worker" else ""
        return all((folder / f"{prefix}-{r}{suffix}").exists() for r in range(job.workers))

    wait_for(lambda: all_there("ready"), 180, "the workers to warm up")
    before = [fabric.counters(i) for i in range(fabric.count)]
    (folder / "go").touch()
    wait_for(lambda: all_there("worker"), 300, f"{steps} steps of every worker")
    after = [fabric.counters(i) for i in range(fabric.count)]
    per_link = [((a[0] - b[0]) / steps, (a[1] - b[1]) / steps) for a, b in zip(after, before, strict=True)]
    workers = [json.loads((folder / f"worker-{r}.json").read_text()) for r in range(job.workers)]
    size = 1 + job.replicas
    primaries = [per_link[i] for i in range(0, slots, size)]
    backups = [per_link[i] for i in range(slots) if i % size]
    measured = {
        "worker_sent": statistics.mean(sent for sent, _ in per_link[slots:]),
        "worker_received": statistics.mean(got for _, got in per_link[slots:]),
        "server_received": statistics.mean(got for _, got in primaries),
        "server_sent": statistics.mean(sent for sent, _ in primaries),
        "backup_received": statistics.mean(got for _, got in backups) if backups else 0.0,
        "network_total": sum(sent for sent, _ in per_link),
    }
    return {"measured_wire": measured, "workers": workers}


def check(job: Job, steps: int, rate_bits: int | None) -> dict[str, Any]:
    """One job measured and compared with the model."""
    run = measure(job, steps, rate_bits)
    wire = run["measured_wire"]
    sized = Job(sum(p.numel() for p in mlp(job.params).parameters()), job.servers, job.workers, job.replicas)
    model = traffic(sized)
    compute = statistics.mean(w["compute_s"] for w in run["workers"])
    step = statistics.mean(w["step_s"] for w in run["workers"])
    predicted = step_time(sized, rate_bits / 8, compute)["step_s"] if rate_bits else None
    return {
        "job": asdict(sized),
        "model": model,
        "measured_wire": wire,
        "measured_app": {"worker_sent": statistics.mean(w["app_sent"] for w in run["workers"]),
                         "worker_received": statistics.mean(w["app_received"] for w in run["workers"])},
        "wire_over_model": {k: (wire[k] / v if v else None) for k, v in model.items()},
        "step_s": step,
        "compute_s": compute,
        "model_step_s": predicted,
        "step_over_model": step / predicted if predicted else None,
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m tensorwire.bench.scaling", description=__doc__)
    parser.add_argument("--params", type=int, default=1 << 20, help="parameters of the measured MLP")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rate", type=float, default=1.0, help="link speed in Gb/s (0: unshaped)")
    parser.add_argument("--jobs", default="1x2,2x2,1x2r1", help="SxW[rR],... jobs to measure")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--table", nargs=3, type=float, metavar=("PARAMS", "WORKERS", "GBITS"),
                        help="print the model's markdown table and exit")  # fmt: skip
    parser.add_argument("--pull", default="fp32", metavar="CODEC",
                        help="--table: the pulls' codec (fp32: none; int8, bf16, fp16)")  # fmt: skip
    parser.add_argument("--markdown", action="store_true", help="also print the measured markdown table")
    parser.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        rank, world, servers, steps, params, folder = args.worker
        worker_main(int(rank), int(world), servers, steps=int(steps), params=int(params), folder=Path(folder))
        return {}
    if args.table:
        pull = bytes_per_element(args.pull)
        print(markdown_table(int(args.table[0]), int(args.table[1]), args.table[2], pull))
        return {}
    rate = int(args.rate * 1e9) if args.rate else None
    result: dict[str, Any] = {"rate_gbit": args.rate, "steps": args.steps, "tcp_overhead": TCP_OVERHEAD}
    try:
        result["runs"] = [
            check(_parse_job(spec, args.params), args.steps, rate) for spec in args.jobs.split(",")
        ]
    except Unavailable as exc:
        result["skipped"] = f"network namespaces are not available here: {exc}"
    if args.markdown and "runs" in result:
        print(measured_markdown(result["runs"]))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return result


def _parse_job(spec: str, params: int) -> Job:
    """``"2x4r1"``: 2 servers (each with 1 backup), 4 workers."""
    servers, _, rest = spec.partition("x")
    workers, _, replicas = rest.partition("r")
    return Job(params, int(servers), int(workers), int(replicas or 0))


if __name__ == "__main__":
    main()
