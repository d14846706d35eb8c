"""The worker side of ``tensorwire bench exchange``: one process per worker averages the same
gradients each way in turn and writes what it measured.

A worker (``python -m tensorwire.bench.exchange_ways SPEC RANK``, inside its network namespace
where there is one) joins a gloo process group first: its barriers start and end each way's timed
steps on every worker at once, and it is the gloo way itself. Each way is set up, checked (every
worker fills its gradients with rank + 1, one step must leave the mean, (W + 1) / 2, in every
element), warmed up, then timed over ``steps`` steps between two barriers, and torn down before the
next way starts. Inside a namespace the worker also reads its own link's byte counters around the
timed steps (/sys/class/net/IFACE/statistics there shows the namespace's own links).

The ways, in this order: tcp before gRPC, because ``ExchangeClient.close`` leaves every server
(the exchange forgets the run and the gRPC way starts again at step 0), while a gRPC caller never
leaves: its sessions would hold the ranks against a later tcp client until they expire.

* ``tcp``: ``ExchangeClient`` over all the exchange servers (ALLREDUCE, pieces split over them).
* ``grpc``: a client generated from ``train.GradientService`` (grpc.aio), one ``UpdateGradient``
  call per piece of the same split, at most ``grpc_window`` calls in flight per server, so the
  means of the first pieces come back while later ones are sent (all at once would interleave
  every call's bytes and finish them all at the end).
* ``gloo``: ``torch.distributed.all_reduce`` over gloo of the gradients laid out in 25 MiB
  buckets, as DistributedDataParallel lays them out (gradient_as_bucket_view), each bucket's
  all_reduce started at once (async_op) and the sum divided by the world size.
* ``nccl``: the same on the GPUs, where every worker has one of its own (loopback only).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
import torch.distributed as dist

from tensorwire.ps.exchange.client import ExchangeClient
from tensorwire.ps.exchange.pieces import split
from tensorwire.types import MiB

BUCKET_BYTES = 25 * MiB  # DistributedDataParallel's default bucket_cap_mb
Step = Callable[[], None]
Spec = dict[str, Any]


def gradient_shapes(nbytes: int, tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """A model's float32 gradients of about ``nbytes`` in ``tensors`` tensors: layers of a weight
    (most of the bytes) and a bias each, like a stack of Linear layers."""
    layers = max(1, tensors // 2)
    per = max(2, nbytes // 4 // layers)  # elements of one layer
    bias = max(1, min(per // 2, int(per**0.5)))
    shapes: list[tuple[str, tuple[int, ...]]] = []
    for i in range(layers):
        shapes += [(f"layer{i}.weight", (bias, (per - bias) // bias)), (f"layer{i}.bias", (bias,))]
    return shapes


# -- the ways -----------------------------------------------------------------------------------------
# Each way is a context manager: given the spec, this worker's rank and the gradients' shapes, it
# sets up, yields (one step, the gradients that step averages in place) and tears down.
Shapes = list[tuple[str, tuple[int, ...]]]
Way = Callable[[Spec, int, Shapes], AbstractContextManager[tuple[Step, dict[str, torch.Tensor]]]]


@contextmanager
def tcp_way(spec: Spec, rank: int, shapes: Shapes) -> Iterator[tuple[Step, dict[str, torch.Tensor]]]:
    grads = {name: torch.zeros(shape) for name, shape in shapes}
    client = ExchangeClient(spec["tcp"], rank=rank, world_size=spec["world"], timeout=spec["timeout"],
                            lanes=spec["lanes"], piece_bytes=spec["piece_bytes"])  # fmt: skip

    def step() -> None:
        count = client.allreduce(grads)
        if count != spec["world"]:
            raise RuntimeError(f"the exchange averaged over {count} workers, not {spec['world']}")

    try:
        yield step, grads
    finally:
        client.close()


@contextmanager
def grpc_way(spec: Spec, rank: int, shapes: Shapes) -> Iterator[tuple[Step, dict[str, torch.Tensor]]]:
    from tensorwire.v1 import gradient_service_pb2 as pb
    from tensorwire.v1 import gradient_service_pb2_grpc as pb_grpc

    grads = {name: torch.zeros(shape) for name, shape in shapes}
    pieces = split([(n, torch.float32, s) for n, s in shapes], len(spec["grpc"]), spec["piece_bytes"])
    flats = [t.view(-1) for t in grads.values()]
    views = [flats[p.tensor][p.start : p.stop].numpy() for p in pieces]
    session = secrets.token_hex(16)
    limit = 1 << 30
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    runner = asyncio.Runner()
    runner.get_loop()  # the channels are made on the runner's loop
    channels = runner.run(_channels(spec["grpc"], options))
    stubs = [pb_grpc.GradientServiceStub(c) for c in channels]  # type: ignore[no-untyped-call]
    clock = iter(range(1 << 62))

    async def one(step: int, number: int, room: asyncio.Semaphore) -> None:
        piece, view = pieces[number], views[number]
        metadata = (("worker-id", str(rank)), ("step", str(step)), ("tensor-name", piece.name),
                    ("world-size", str(spec["world"])), ("session", session))  # fmt: skip
        async with room:
            reply = await stubs[piece.server].UpdateGradient(
                pb.GradientRequest(gradient=view.tobytes()), metadata=metadata, timeout=spec["timeout"]
            )
        view[:] = np.frombuffer(reply.updated_gradient, dtype=np.float32)

    async def step() -> None:
        number = next(clock)
        rooms = [asyncio.Semaphore(spec["grpc_window"]) for _ in channels]
        await asyncio.gather(*(one(number, n, rooms[p.server]) for n, p in enumerate(pieces)))

    try:
        yield (lambda: runner.run(step())), grads
    finally:
        for channel in channels:
            runner.run(channel.close())
        runner.close()


async def _channels(targets: list[str], options: list[tuple[str, int]]) -> list[grpc.aio.Channel]:
    return [grpc.aio.insecure_channel(t, options=options) for t in targets]


@contextmanager
def gloo_way(spec: Spec, rank: int, shapes: Shapes) -> Iterator[tuple[Step, dict[str, torch.Tensor]]]:
    del spec, rank
    yield _bucketed(shapes, "cpu", None)


@contextmanager
def nccl_way(spec: Spec, rank: int, shapes: Shapes) -> Iterator[tuple[Step, dict[str, torch.Tensor]]]:
    device = f"cuda:{rank % torch.cuda.device_count()}"
    torch.cuda.set_device(device)
    group = dist.new_group(list(range(spec["world"])), backend="nccl")
    step, grads = _bucketed(shapes, device, group)

    def synced() -> None:
        step()
        torch.cuda.synchronize()

    try:
        yield synced, grads
    finally:
        dist.destroy_process_group(group)


def _bucketed(shapes: Shapes, device: str, group: Any) -> tuple[Step, dict[str, torch.Tensor]]:
    """Gradients laid out in buckets of at most BUCKET_BYTES (a larger tensor alone in one), as
    views of them, and a step that all-reduces every bucket (all started at once) and divides."""
    sizes = [math.prod(shape) for _, shape in shapes]
    lengths: list[int] = []
    for numel in sizes:
        if not lengths or lengths[-1] + numel > BUCKET_BYTES // 4:
            lengths.append(0)
        lengths[-1] += numel
    flats = [torch.zeros(n, device=device) for n in lengths]
    grads, bucket, offset = {}, 0, 0
    for (name, shape), numel in zip(shapes, sizes, strict=True):
        if offset + numel > lengths[bucket]:
            bucket, offset = bucket + 1, 0
        grads[name] = flats[bucket][offset : offset + numel].view(shape)
        offset += numel
    world = dist.get_world_size()

    def step() -> None:
        works = [dist.all_reduce(f, async_op=True, group=group) for f in flats]
        for work in works:
            work.wait()
        for f in flats:
            f.div_(world)

    return step, grads


WAYS: dict[str, Way] = {"tcp": tcp_way, "grpc": grpc_way, "gloo": gloo_way, "nccl": nccl_way}


# -- one worker ---------------------------------------------------------------------------------------
def measure(way: str, spec: Spec, rank: int, shapes: Shapes) -> dict[str, float]:
    """Check, warm up and time one way (see the module doc)."""
    world = spec["world"]
    with WAYS[way](spec, rank, shapes) as (step, grads):
        for t in grads.values():
            t.fill_(rank + 1)
        step()
        want = (world + 1) / 2
        if not all(bool((t == want).all()) for t in grads.values()):
            raise RuntimeError(f"the {way} way did not leave the mean {want} in every gradient")
        for _ in range(spec["warmup"]):
            step()
        dist.barrier()
        before = _link(spec, rank)
        times = []
        for _ in range(spec["steps"]):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        after = _link(spec, rank)
        dist.barrier()  # every worker's last step is done before any tears its way down
    # The median step: a step another process's burst of CPU held up does not move it.
    result = {"step_s": statistics.median(times), "mean_step_s": statistics.fmean(times)}
    if before is not None and after is not None:
        result["link_sent"] = (after[0] - before[0]) / spec["steps"]
        result["link_received"] = (after[1] - before[1]) / spec["steps"]
    return result


def _link(spec: Spec, rank: int) -> tuple[int, int] | None:
    """(bytes sent, bytes received) on this worker's link, inside its namespace; None on loopback."""
    iface = spec["ifaces"][rank] if spec.get("ifaces") else None
    if iface is None:
        return None
    stats = Path("/sys/class/net") / iface / "statistics"
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def _join(spec: Spec, rank: int) -> None:
    """The gloo group: through the store the parent holds (loopback), or one rank 0 opens at the
    spec's fixed port (in namespaces, where no other process can take that port)."""
    timeout = timedelta(seconds=spec["timeout"])
    if spec.get("store_in_parent"):
        host, port = spec["master"].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=rank, world_size=spec["world"], timeout=timeout)
    else:
        dist.init_process_group("gloo", init_method=f"tcp://{spec['master']}", rank=rank,
                                world_size=spec["world"], timeout=timeout)  # fmt: skip


def worker_main(spec_path: Path, rank: int) -> None:
    spec: Spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    if spec.get("ifaces"):
        os.environ["GLOO_SOCKET_IFNAME"] = spec["ifaces"][rank]
    _join(spec, rank)
    try:
        shapes = gradient_shapes(spec["bytes"], spec["tensors"])
        results = {way: measure(way, spec, rank, shapes) for way in spec["ways"]}
        out = spec_path.parent / f"result-{rank}.json"
        out.with_suffix(".tmp").write_text(json.dumps(results))
        out.with_suffix(".tmp").rename(out)  # whole or not at all: the parent polls for it
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(Path(sys.argv[1]), int(sys.argv[2]))
