"""Benchmarks of tensorwire against the baselines it should be judged against.

Each benchmark is a module ``tensorwire.bench.<name>`` with ``main(argv) -> dict`` (its own options;
``--json`` prints the dict as one line). ``BENCHMARKS`` is the one table of them: the CLI makes a
``tensorwire bench <name>`` command of each entry, and ``tensorwire bench all`` runs every entry,
with its ``report_args`` (short enough that the whole report takes under 15 minutes on a 2-core
machine) or, with ``--quick``, its ``quick_args`` (None: left out of a quick run). A new benchmark
is one module and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str
    summary: str  # the one-line help of ``tensorwire bench <name>``
    # What ``bench all`` runs it with (None: left out; "{out}" stands for the report's folder).
    report_args: tuple[str, ...] | None = ()
    quick_args: tuple[str, ...] | None = None  # what ``bench all --quick`` runs it with (None: skip)


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark(
            "transfer",
            "Transfer throughput against plain sockets (--size, --json, --iters, --many...).",
            ("--size", "256MiB", "--iters", "3", "--small-iters", "1000", "--many", "2000"),
            (
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
            ),
        ),
        Benchmark(
            "grpc",
            "gRPC throughput against naive gRPC and Arrow Flight (--size, --json, --iters...).",
            ("--size", "64MiB", "--iters", "3"),
            ("--size", "1MiB", "--iters", "1"),
        ),
        Benchmark(
            "ps",
            "Parameter-server training against a torch.distributed.rpc PS and DDP (--json, --steps...).",
            ("--steps", "10", "--warmup", "2"),
            ("--sizes", "32,64,10", "--batch", "16", "--steps", "3", "--warmup", "1"),
        ),
        Benchmark(
            "chaos",
            "Replicated parameter servers while processes are killed (--minutes, --interval, --json).",
            ("--minutes", "0.4", "--interval", "8"),
        ),
        Benchmark(
            "compression",
            "Lossy codecs: bytes, GB/s, digits accuracy with/without error feedback (--json, --plot).",
            ("--plot", "{out}/compression.png"),
            (
                "--codecs",
                "int8,topk:0.01",
                "--epochs",
                "2",
                "--size",
                "1048576",
                "--repeats",
                "2",
                "--plot",
                "{out}/compression.png",
            ),
        ),
        Benchmark(
            "scaling",
            "PS bytes per step across network namespaces vs the model (--json, --jobs, --table).",
            None,  # needs root (network namespaces) and ~2 minutes: docs/explanation/scaling.md has its table
        ),
        Benchmark(
            "gpu",
            "The CUDA tests, PS training on a GPU vs one GPU, staging GB/s vs torch copies "
            "(--json, --tests DIR, --require).",
            None,  # `make gpu-check` runs it where there is a GPU; elsewhere it skips
        ),
        Benchmark(
            "exchange",
            "Gradient averaging: the exchange over tcp:// and gRPC vs gloo all_reduce, in network "
            "namespaces and on loopback (--json, --bytes, --no-netns).",
            None,  # needs root for namespaces and a few minutes: README has its table
            ("--no-netns", "--bytes", "4000000", "--steps", "2", "--warmup", "1"),
        ),
        Benchmark(
            "broadcast",
            "One origin, N readers in network namespaces: one reader vs all at once from the origin, "
            "the link's bound, the origin's egress (--json, --readers, --size, --rate, --no-netns).",
            None,  # needs root for namespaces and ~75 s: README's Performance section has its figures
            ("--no-netns", "--readers", "2", "--size", "1MiB", "--tensors", "12"),
        ),
        Benchmark(
            "reshard",
            "Sharded state from 4 ranks (Shard(0)) into 2 (Shard(1)) and back: tensorwire vs "
            "torch.distributed.checkpoint on /dev/shm, bytes moved vs the overlap, async save "
            "blocking (--json, --size, --rows, --repeats, --transport).",
            ("--repeats", "2"),  # ~75 s on 2 cores: the first round pays for fresh pages
            ("--size", "1MiB", "--rows", "16", "--timeout", "120"),
        ),
        Benchmark(
            "peers",
            "tensorwire next to Ray's object store, the Mooncake Transfer Engine (TCP) and gloo "
            "send/recv on the same bytes (--json, --peers ray,mooncake,gloo, --size, --ray-size).",
            ("--size", "256MiB", "--iters", "3", "--small-iters", "500"),  # ~40 s: Ray's start is most
            (
                "--peers",
                "gloo,mooncake",
                "--size",
                "1MiB",
                "--iters",
                "1",
                "--small-iters",
                "20",
                "--many",
                "9",
            ),
        ),
        Benchmark(
            "engines",
            "vLLM engines' weight updates through tensorwire vs collective_rpc(state_dict), the "
            "link's bound, deltas' bytes, the origin's egress to 2 engines (--json, --mib, --engines).",
            None,  # needs vLLM (the engines' virtualenv: make bench-engines) and ~3 minutes
        ),
        Benchmark(
            "sweep",
            "Bandwidth by tensor size (4 KiB to 256 MiB), latency percentiles, CPU s/GB and peak RSS "
            "per transport and peer (--max-size, --json).",
            (),
            (
                "--max-size",
                "64KiB",
                "--budget",
                "1MiB",
                "--latency-iters",
                "50",
                "--cpu-size",
                "1MiB",
                "--transports",
                "tcp",
            ),
        ),
    )
}

__all__ = ["BENCHMARKS", "Benchmark"]
