"""Peer baselines for the parameter-server benchmark: what PyTorch itself offers for the same job.

Both train the same MLP (``make_model``) on the same synthetic batches (``synthetic_batch``) with
plain SGD, one thread per process, and report training samples per second: all samples the
trainers processed in the timed steps over the slowest trainer's wall time for those steps.

* ``rpc_ps_samples_per_s``: a parameter server on ``torch.distributed.rpc`` (TensorPipe), written
  the way the PyTorch tutorial "Implementing Batch RPC Processing Using Asynchronous Executions"
  writes it: a ``BatchUpdateParameterServer`` whose ``@rpc.functions.async_execution`` method
  accumulates the gradients of every trainer, averages them, steps ``SGD`` once and answers all
  trainers with the updated parameters. It is the synchronous PS any PyTorch user can build from
  the standard library, so it is the peer a tensorwire PS must beat at the same job: the same
  traffic pattern (gradients up, parameters down, through one server process).
* ``ddp_samples_per_s``: ``DistributedDataParallel`` over gloo, each worker stepping its own
  ``SGD`` after an all-reduce of the gradients. Not a PS at all, but the same synchronous
  data-parallel SGD, and what a user would pick instead of a PS on one machine: the ceiling.

Processes: every role runs in a child started with ``spawn`` (never ``fork``: the parent may hold
threads and torch state) by ``run_children``, which ``bench ps`` and ``bench ps --comm`` use too.
A child sends ``("ok", value)`` or ``("error", traceback)`` through its pipe and exits; the parent
waits on all pipes with one finite deadline, re-raises a child's error as ``RuntimeError`` naming
that child, and terminates (then kills) every child that is still running when it returns or
raises, including on ``KeyboardInterrupt``.

Clock: the timed steps start after ``warmup`` untimed ones. In the RPC PS the last warmup update
is the barrier (the server answers every trainer at once); DDP workers meet at ``dist.barrier``.

Run: ``python -m tensorwire.bench.ps_baselines [--sizes 1024,2048,2048,2048,10] [--steps 30]``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import rpc
from torch.nn.parallel import DistributedDataParallel

PS_NAME = "ps"
RPC_WORKER_THREADS = 8
STOP_TIMEOUT = 5.0  # for a child to exit by itself, then again after terminate and after kill
_HOST = "127.0.0.1"
_MIX = 1_000_003  # a prime for mixing (seed, rank, step) into one generator seed

Job = tuple[str, Callable[..., object], tuple[object, ...]]  # child name, target, its arguments


@dataclass(frozen=True)
class Workload:
    """One training job for both baselines; the defaults make a ~10.5M-parameter MLP."""

    sizes: tuple[int, ...] = (1024, 2048, 2048, 2048, 10)  # layer widths: input, hidden..., classes
    batch: int = 64  # samples per worker per step
    steps: int = 30  # timed steps per worker
    warmup: int = 3  # untimed steps before them; at least 1, the last one starts the clock
    workers: int = 2  # trainer processes (the RPC PS adds one server process)
    lr: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if len(self.sizes) < 2 or min(self.sizes) < 1:
            raise ValueError(f"sizes needs at least two positive widths, got {self.sizes}")
        if min(self.batch, self.steps, self.warmup, self.workers) < 1:
            raise ValueError(f"batch, steps, warmup and workers must be >= 1: {self}")


def param_count(w: Workload) -> int:
    """Parameters of ``make_model(w)``: weights and biases of every Linear."""
    return sum(n_in * n_out + n_out for n_in, n_out in itertools.pairwise(w.sizes))


def make_model(w: Workload) -> nn.Module:
    """Linear+ReLU layers (no ReLU after the last), initialised from ``w.seed`` alone."""
    layers: list[nn.Module] = []
    with torch.random.fork_rng(devices=[]):  # same weights in every process, global RNG untouched
        torch.manual_seed(w.seed)
        for index, (n_in, n_out) in enumerate(itertools.pairwise(w.sizes)):
            if index > 0:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def synthetic_batch(w: Workload, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``[batch, sizes[0]]`` (float32) and class labels in ``[0, sizes[-1])`` (int64)."""
    generator = torch.Generator().manual_seed(((w.seed * _MIX + rank) * _MIX + step) % (1 << 63))
    x = torch.randn(w.batch, w.sizes[0], generator=generator)
    y = torch.randint(0, w.sizes[-1], (w.batch,), generator=generator)
    return x, y


def _batches(w: Workload, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Made before the clock starts: the benchmark times training, not the data generator.
    return [synthetic_batch(w, rank, step) for step in range(w.warmup + w.steps)]


def _backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    torch.autograd.backward(F.cross_entropy(model(x), y))


def samples_per_s(w: Workload, elapsed: Sequence[object]) -> float:
    seconds = [value for value in elapsed if isinstance(value, float)]
    if len(seconds) != w.workers:
        raise RuntimeError(f"expected {w.workers} trainer times, got {list(elapsed)}")
    return w.workers * w.batch * w.steps / max(seconds)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


# -- RPC parameter server --------------------------------------------------------------------------
class BatchUpdateParameterServer:
    """The tutorial's batch-update PS: one SGD step per round, once all trainers sent gradients.

    Lifecycle: the server process builds it before ``init_rpc``; each trainer fetches an RRef to
    it (``_server_rref``) and then calls ``update_and_fetch_model`` once per step. Every call of a
    round gets the same future, resolved by the last gradient of the round.
    """

    def __init__(self, w: Workload) -> None:
        self.model = make_model(w)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.SGD(self.params, lr=w.lr)
        self.trainers = w.workers
        self.received = 0
        self.lock = threading.Lock()  # calls arrive on several RPC threads at once
        self.future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        for param in self.params:
            param.grad = torch.zeros_like(param)

    @staticmethod
    @rpc.functions.async_execution  # type: ignore[untyped-decorator]  # torch leaves it untyped
    def update_and_fetch_model(
        ps_rref: rpc.RRef[BatchUpdateParameterServer], grads: list[torch.Tensor]
    ) -> torch.futures.Future[list[torch.Tensor]]:
        server: BatchUpdateParameterServer = ps_rref.local_value()
        return server.add_gradients(grads)

    def add_gradients(self, grads: list[torch.Tensor]) -> torch.futures.Future[list[torch.Tensor]]:
        """Accumulate one trainer's gradients; the future resolves with the round's parameters."""
        with self.lock:
            for param, grad in zip(self.params, grads, strict=True):
                _grad_of(param).add_(grad)
            self.received += 1
            future = self.future
            if self.received == self.trainers:
                self._step()
                # The reply aliases the live parameters, as the tutorial's does: safe, because the
                # next step needs every trainer's next gradients, sent only after its reply arrived.
                future.set_result([param.detach() for param in self.params])
                self.future = torch.futures.Future()
                self.received = 0
        return future

    def _step(self) -> None:
        for param in self.params:
            _grad_of(param).div_(self.trainers)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # keep the accumulators allocated


def _grad_of(param: torch.Tensor) -> torch.Tensor:
    if param.grad is None:
        raise RuntimeError("a parameter has no gradient")
    return param.grad


_SERVER: BatchUpdateParameterServer | None = None  # set in the server process only


def _server_rref() -> rpc.RRef[BatchUpdateParameterServer]:
    """Runs on the server (called by trainers over RPC): an RRef to its parameter server."""
    if _SERVER is None:
        raise RuntimeError("this process holds no parameter server")
    return rpc.RRef(_SERVER)


def _init_rpc(name: str, rank: int, w: Workload, port: int, timeout: float) -> None:
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=RPC_WORKER_THREADS, rpc_timeout=timeout, init_method=f"tcp://{_HOST}:{port}"
    )
    with warnings.catch_warnings():
        # init_rpc trips torch's own deprecation warning (it hands a gloo Backend to a collective).
        warnings.filterwarnings("ignore", "You are using a Backend", UserWarning)
        rpc.init_rpc(name, rank=rank, world_size=w.workers + 1, rpc_backend_options=options)  # type: ignore[no-untyped-call]


def _rpc_server(w: Workload, port: int, timeout: float) -> None:
    global _SERVER
    _SERVER = BatchUpdateParameterServer(w)  # before init_rpc, so no trainer can ask too early
    _init_rpc(PS_NAME, 0, w, port, timeout)
    rpc.shutdown(graceful=True, timeout=timeout)  # returns once every trainer shut down too


def _rpc_trainer(w: Workload, rank: int, port: int, timeout: float) -> float:
    """Train against the server; the seconds the timed steps took."""
    model = make_model(w)
    batches = _batches(w, rank)
    _init_rpc(f"trainer{rank}", rank + 1, w, port, timeout)
    ps_rref: rpc.RRef[BatchUpdateParameterServer] = rpc.rpc_sync(PS_NAME, _server_rref)
    for x, y in batches[: w.warmup]:
        _rpc_step(model, ps_rref, x, y)
    start = time.perf_counter()  # just after the last warmup round released every trainer
    for x, y in batches[w.warmup :]:
        _rpc_step(model, ps_rref, x, y)
    elapsed = time.perf_counter() - start
    del ps_rref  # let graceful shutdown release it
    rpc.shutdown(graceful=True, timeout=timeout)
    return elapsed


def _rpc_step(
    model: nn.Module, ps_rref: rpc.RRef[BatchUpdateParameterServer], x: torch.Tensor, y: torch.Tensor
) -> None:
    _backward(model, x, y)
    grads = [_grad_of(param) for param in model.parameters()]
    params: list[torch.Tensor] = rpc.rpc_sync(
        PS_NAME, BatchUpdateParameterServer.update_and_fetch_model, args=(ps_rref, grads)
    )
    with torch.no_grad():
        for param, new in zip(model.parameters(), params, strict=True):
            param.copy_(new)


def rpc_ps_samples_per_s(w: Workload, timeout: float = 300.0) -> float:
    """Samples/s of the tutorial's batch-update PS: 1 server and ``w.workers`` trainer processes."""
    port = _free_port()
    jobs: list[Job] = [("rpc parameter server", _rpc_server, (w, port, timeout))]
    jobs += [(f"rpc trainer {rank}", _rpc_trainer, (w, rank, port, timeout)) for rank in range(w.workers)]
    results = run_children("rpc parameter server and trainers", jobs, timeout)
    return samples_per_s(w, results[1:])


# -- DistributedDataParallel -----------------------------------------------------------------------
def _ddp_worker(w: Workload, rank: int, port: int, timeout: float) -> float:
    """Train one DDP replica; the seconds the timed steps took."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{_HOST}:{port}",
        rank=rank,
        world_size=w.workers,
        timeout=timedelta(seconds=timeout),
    )
    model = DistributedDataParallel(make_model(w))
    optimizer = torch.optim.SGD(model.parameters(), lr=w.lr)
    batches = _batches(w, rank)
    for x, y in batches[: w.warmup]:
        _backward(model, x, y)
        optimizer.step()
    dist.barrier()
    start = time.perf_counter()
    for x, y in batches[w.warmup :]:
        _backward(model, x, y)  # DDP all-reduces (averages) the gradients during backward
        optimizer.step()
    elapsed = time.perf_counter() - start
    dist.destroy_process_group()
    return elapsed


def ddp_samples_per_s(w: Workload, timeout: float = 300.0) -> float:
    """Samples/s of ``w.workers`` DistributedDataParallel (gloo) processes."""
    port = _free_port()
    jobs: list[Job] = [
        (f"ddp worker {rank}", _ddp_worker, (w, rank, port, timeout)) for rank in range(w.workers)
    ]
    return samples_per_s(w, run_children("ddp workers", jobs, timeout))


# -- child processes -------------------------------------------------------------------------------
@dataclass
class _Child:
    name: str
    process: BaseProcess
    conn: Connection  # the parent's end; the child sends exactly one ("ok" | "error", value)


def run_children(what: str, jobs: Sequence[Job], timeout: float) -> list[object]:
    """Run every job in its own spawned child; their results in job order.

    Raises ``TimeoutError`` if they are not all done within ``timeout`` seconds, ``RuntimeError``
    naming the child if one fails or dies. No child outlives this call.
    """
    ctx = multiprocessing.get_context("spawn")
    children: list[_Child] = []
    finished = False
    try:
        for name, target, args in jobs:
            children.append(_start(ctx, name, target, args))
        results = _collect(children, what, timeout)
        finished = True
        return [results[child.name] for child in children]
    finally:
        # After a success the children are exiting by themselves; after a failure, do not wait.
        _reap(children, STOP_TIMEOUT if finished else 0.0)


def _start(ctx: SpawnContext, name: str, target: Callable[..., object], args: tuple[object, ...]) -> _Child:
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    # daemon: should even _reap be interrupted, multiprocessing ends the child when the parent exits.
    process = ctx.Process(target=_child_main, args=(child_conn, target, args), name=name, daemon=True)
    try:
        process.start()
    except BaseException:
        parent_conn.close()
        raise
    finally:
        child_conn.close()  # only the child's copy may stay open, so its death reads as EOF
    return _Child(name, process, parent_conn)


def _child_main(conn: Connection, target: Callable[..., object], args: tuple[object, ...]) -> None:
    torch.set_num_threads(1)  # several processes share the machine's cores
    code = 1
    try:
        conn.send(("ok", target(*args)))
        code = 0
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip the interpreter's teardown: slow with torch loaded, and after a failure an RPC
        # agent's threads could hold it up. The parent has the result already.
        os._exit(code)


def _collect(children: list[_Child], what: str, timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    results: dict[str, object] = {}
    pending = list(children)
    while pending:
        left = deadline - time.monotonic()
        running = ", ".join(child.name for child in pending)
        if left <= 0:
            raise TimeoutError(f"waited {timeout:.0f}s for the {what} to finish (still running: {running})")
        # The sentinels too, so that a child that died is noticed at once, not at the deadline.
        waitables = [child.conn for child in pending] + [child.process.sentinel for child in pending]
        multiprocessing.connection.wait(waitables, left)
        for child in [child for child in pending if _has_reported(child)]:
            results[child.name] = _receive(child)
            pending.remove(child)
    return results


def _has_reported(child: _Child) -> bool:
    # A child that exited has closed its end of the pipe, so the pipe polls readable (data or EOF).
    return child.conn.poll() or child.process.exitcode is not None


def _receive(child: _Child) -> object:
    message = _read(child.conn)
    if message is None:
        child.process.join(STOP_TIMEOUT)
        raise RuntimeError(f"{child.name} exited with code {child.process.exitcode} without a result")
    kind, value = message
    if kind != "ok":
        raise RuntimeError(f"{child.name} failed:\n{value}")
    return value


def _read(conn: Connection) -> tuple[str, object] | None:
    """The child's one message, or None if it closed the pipe without sending it."""
    if not conn.poll():
        return None
    try:
        message: tuple[str, object] = conn.recv()
    except EOFError:
        return None
    return message


def _reap(children: list[_Child], grace: float) -> None:
    """Wait up to ``grace`` seconds for the children to exit, then terminate, then kill them."""
    _join_all(children, grace)
    for child in children:
        if child.process.is_alive():
            child.process.terminate()
    _join_all(children, STOP_TIMEOUT)
    for child in children:
        if child.process.is_alive():
            child.process.kill()
    _join_all(children, STOP_TIMEOUT)
    for child in children:
        child.conn.close()
        if not child.process.is_alive():
            child.process.close()


def _join_all(children: list[_Child], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for child in children:
        child.process.join(max(0.0, deadline - time.monotonic()))


# -- command line ----------------------------------------------------------------------------------
def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of widths: {text!r}") from None


def _parse_args(argv: Sequence[str] | None) -> tuple[Workload, float]:
    default = Workload()
    parser = argparse.ArgumentParser(prog="python -m tensorwire.bench.ps_baselines", description=__doc__)
    parser.add_argument("--sizes", type=_sizes, default=default.sizes, help="MLP widths, e.g. 1024,2048,10")
    parser.add_argument("--batch", type=int, default=default.batch, help="samples per worker per step")
    parser.add_argument("--steps", type=int, default=default.steps, help="timed steps")
    parser.add_argument("--warmup", type=int, default=default.warmup, help="untimed steps first (>= 1)")
    parser.add_argument("--workers", type=int, default=default.workers, help="trainer processes")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each baseline")
    args = parser.parse_args(argv)
    workload = Workload(args.sizes, args.batch, args.steps, args.warmup, args.workers)
    return workload, args.timeout


def main(argv: Sequence[str] | None = None) -> dict[str, float | int]:
    """Run both baselines and print one JSON line with their samples/s."""
    w, timeout = _parse_args(argv)
    result: dict[str, float | int] = {
        "params": param_count(w),
        "rpc_ps_samples_per_s": rpc_ps_samples_per_s(w, timeout),
        "ddp_samples_per_s": ddp_samples_per_s(w, timeout),
    }
    if not all(math.isfinite(value) for value in result.values()):
        raise RuntimeError(f"a baseline measured no finite rate: {result}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
