"""The GPU check (``make gpu-check``): the CUDA tests, then a short benchmark of the CUDA paths.

On a machine with a CUDA device, in one run:

* ``--tests DIR``: ``pytest -m cuda DIR`` in a child process (the tests that skip without a
  device: the worker, the exchange, codecs on the device, put/get staging). ``cuda_tests``: passed
  or failed.
* Training: an MLP on the GPU trained through 2 parameter servers (processes) by 2 workers
  (threads, one GPU) in sync mode, against one GPU training the same model at the combined batch
  size with ``torch.optim``: ``ps_vs_single_gpu_max_diff`` (target <= 1e-5, ``ps_matches_single_gpu``).
* Staging: the bytes of one tensor copied device -> pinned host and back by the staging the
  parameter server uses (``ps/worker/device.py``: pieces on a side stream, each awaited as a transport
  would), next to plain torch copies of the same bytes into a pinned buffer (``pinned.copy_(x,
  non_blocking=True)``, then a synchronize): ``staging_d2h_gbps`` / ``torch_d2h_gbps`` and the same
  for h2d, with their ratios (target: about 1, the staging adds no copy).
* Exchange: ``allreduce`` of a CUDA tensor over loopback (one worker, a server process) next to the
  same bytes on the CPU: ``exchange_cuda_vs_cpu`` is what the staging costs a real send once the
  copies overlap it (target: about 1).

Without a CUDA device (or with a torch built without CUDA) it prints why and exits 0, or, with
``--require``, exits non-zero. A failed check (a test, the 1e-5 match) exits non-zero after the
JSON line. Run: ``tensorwire bench gpu [--json] [--tests tests] [--require]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

import torch
import torch.nn.functional as F

from tensorwire.bench.report import show
from tensorwire.client.staging import HostCopier
from tensorwire.ps import SGD, Worker
from tensorwire.ps.exchange.client import ExchangeClient
from tensorwire.ps.launch import local_servers
from tensorwire.ps.worker.device import DeviceStaging
from tensorwire.types import MiB

Result = dict[str, float | int | str | bool | None]
MATCH = 1e-5
WORKERS = 2


def main(argv: Sequence[str] | None = None) -> Result:
    parser = argparse.ArgumentParser(prog="tensorwire bench gpu", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--require", action="store_true", help="fail (exit 2) where there is no CUDA device")
    parser.add_argument("--tests", metavar="DIR", help="run `pytest -m cuda DIR` first")
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--batch", type=int, default=32, help="samples per worker per step")
    parser.add_argument("--size", type=int, default=256 * MiB, help="bytes staged each way")
    parser.add_argument("--repeats", type=int, default=5, help="timed copies of each kind (median)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        why = "no CUDA device" if torch.version.cuda else f"torch {torch.__version__} is built without CUDA"
        print(f"gpu check skipped: {why}", file=sys.stderr, flush=True)
        if args.require:
            raise SystemExit(2)
        return show({"cuda": False, "skipped": why}, args.json, lambda r: None)
    result: Result = {"cuda": True, "device": torch.cuda.get_device_name(), "torch_cuda": torch.version.cuda}
    if args.tests:
        result["cuda_tests"] = _pytest(args.tests)
    result.update(measure(torch.device("cuda"), args.steps, args.batch, args.size, args.repeats))
    show(result, args.json, _readable)
    failed = [] if result.get("cuda_tests") in (None, "passed") else ["cuda_tests"]
    failed += [] if result["ps_matches_single_gpu"] else ["ps_matches_single_gpu"]
    if failed:
        raise SystemExit(f"gpu check failed: {', '.join(failed)}")
    return result


def measure(device: torch.device, steps: int, batch: int, size: int, repeats: int) -> Result:
    """The benchmark's figures on ``device`` (the CPU in the smoke test: the same code, unstaged)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the 1e-5 match compares fp32 sums
    try:
        result = _training(device, steps, batch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    result.update(_staging(device, size, repeats))
    result.update(_exchange(device, min(size, 64 * MiB), repeats))
    return result


def _pytest(folder: str) -> str:
    # pytest's report goes to stderr: stdout keeps the one JSON line
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "cuda", folder], stdout=sys.stderr)
    return "passed" if rc == 0 else f"failed (pytest exit {rc})"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- training: 2 servers, 2 workers on one GPU, against one GPU at the combined batch -------------
def _model(device: torch.device) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512), torch.nn.Tanh(),
            torch.nn.Linear(512, 10),
        )  # fmt: skip
    return model.to(device)


def _training(device: torch.device, steps: int, batch: int) -> Result:
    gen = torch.Generator().manual_seed(1)
    rows = steps * WORKERS * batch
    x = torch.randn(rows, 256, generator=gen).to(device)
    y = torch.randint(0, 10, (rows,), generator=gen).to(device)
    spec = SGD(lr=0.05, momentum=0.9)
    single = _model(device)
    optimizer = spec.build(single.parameters())
    for step in range(steps):
        at = slice(step * WORKERS * batch, (step + 1) * WORKERS * batch)
        optimizer.zero_grad()
        F.cross_entropy(single(x[at]), y[at]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    models = [_model(device) for _ in range(WORKERS)]
    times: list[float] = []

    def work(rank: int, urls: list[str]) -> None:
        with Worker(models[rank], urls, "sync", spec, rank=rank, world_size=WORKERS) as worker:
            start = time.perf_counter()
            for step in range(steps):
                at = slice(step * WORKERS * batch + rank * batch, step * WORKERS * batch + (rank + 1) * batch)
                F.cross_entropy(models[rank](x[at]), y[at]).backward()  # type: ignore[no-untyped-call]
                worker.step()
            _sync(device)
            times.append((time.perf_counter() - start) / steps)

    with local_servers(2) as urls:
        _threads(work, urls)
    diff = max(
        float((p.detach() - q.detach()).abs().max())
        for m in models
        for p, q in zip(m.parameters(), single.parameters(), strict=True)
    )
    return {
        "ps_steps": steps,
        "ps_step_s": max(times),
        "ps_vs_single_gpu_max_diff": diff,
        "ps_matches_single_gpu": diff <= MATCH,
    }


def _threads(work: Callable[[int, list[str]], None], urls: list[str]) -> None:
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            work(rank, urls)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), name=f"gpu-worker-{r}") for r in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a GPU worker did not finish in 600 s")


# -- staging copies against plain torch copies --------------------------------------------------------
def _median_gbps(device: torch.device, nbytes: int, repeats: int, once: Callable[[], None]) -> float:
    once()  # warm: buffers made, streams created
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def _median_gbps_on_loop(
    device: torch.device, nbytes: int, repeats: int, once: Callable[[], Awaitable[None]]
) -> float:
    """``_median_gbps`` of a coroutine, every repeat on one event loop (as a worker's are)."""

    async def timed() -> float:
        await once()
        times = []
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            await once()
            times.append(time.perf_counter() - start)
        return nbytes / statistics.median(times) / 1e9

    return asyncio.run(timed())


def _staging(device: torch.device, nbytes: int, repeats: int) -> Result:
    x = torch.randn(nbytes // 4, device=device)
    cuda = device.type == "cuda"
    pinned = torch.empty(x.numel(), dtype=x.dtype, pin_memory=cuda)
    staging = DeviceStaging.for_device(device) or DeviceStaging(HostCopier(), pin=False)

    def torch_d2h() -> None:
        pinned.copy_(x, non_blocking=cuda)
        _sync(device)

    def torch_h2d() -> None:
        x.copy_(pinned, non_blocking=cuda)
        _sync(device)

    async def d2h() -> None:
        staging.after_compute()
        staged, _ = await staging.send("bench", [x])
        await staged.ready(x.numel() * 4)  # as the transport does, piece by piece: here the last one

    async def h2d() -> None:
        hosts = await staging.receive("bench", [x.numel() * 4])
        staging.land("bench", [x], hosts)
        staging.order_compute()
        if cuda:
            torch.cuda.current_stream(device).synchronize()

    result: Result = {
        "staging_bytes": x.numel() * 4,
        "torch_d2h_gbps": _median_gbps(device, nbytes, repeats, torch_d2h),
        "staging_d2h_gbps": _median_gbps_on_loop(device, nbytes, repeats, d2h),
        "torch_h2d_gbps": _median_gbps(device, nbytes, repeats, torch_h2d),
        "staging_h2d_gbps": _median_gbps_on_loop(device, nbytes, repeats, h2d),
        "staging_pinned": bool(staging.arenas["bench"].buffer.is_pinned()),
    }
    result["staging_d2h_vs_torch"] = _ratio(result["staging_d2h_gbps"], result["torch_d2h_gbps"])
    result["staging_h2d_vs_torch"] = _ratio(result["staging_h2d_gbps"], result["torch_h2d_gbps"])
    return result


def _exchange(device: torch.device, nbytes: int, repeats: int) -> Result:
    on = {"device": torch.randn(nbytes // 4, device=device), "cpu": torch.randn(nbytes // 4)}
    with local_servers(1) as urls, ExchangeClient(urls[0], rank=0, world_size=1) as client:
        gbps = {
            where: _median_gbps(device, nbytes, repeats, functools.partial(_allreduce, client, t))
            for where, t in on.items()
        }
    return {
        "exchange_bytes": nbytes,
        "exchange_cuda_gbps": gbps["device"],
        "exchange_cpu_gbps": gbps["cpu"],
        "exchange_cuda_vs_cpu": _ratio(gbps["device"], gbps["cpu"]),
    }


def _allreduce(client: ExchangeClient, tensor: torch.Tensor) -> None:
    client.allreduce({"g": tensor})
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()  # the means are on the device


def _ratio(a: object, b: object) -> float | None:
    return a / b if isinstance(a, float) and isinstance(b, float) and b else None


def _readable(r: Result) -> str:
    return "\n".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.items())


if __name__ == "__main__":
    main()
