"""The ranks of ``bench reshard``: one spawned process per rank of a gloo world, answering requests.

Lifecycle: the parent starts every rank of a world as a ``Child(rank_main, Place(world, rank,
store_port, url), setup)``; each joins its world's gloo process group through the parent's TCPStore (under a
prefix of the world's name, so two worlds share one store), builds its part of the state dict
(``setup.tensors`` float32 DTensors of ``setup.shape``, ``Shard(world.dim)`` over the world), opens
a client of the tensorwire server and reports ready. It then answers the requests the parent
``tell``s every rank of the world at once (the table ``OPS``): each is a collective, timed between
two barriers, and every read is checked against the pattern the state was filled with before its
answer goes back. The parent stops it when the run is over.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from tensorwire import sharded
from tensorwire.bench.children import serve_requests, starting
from tensorwire.client import Client, connect
from tensorwire.dcp import StorageReader, StorageWriter
from tensorwire.sharded.checkpoint import AsyncSaver
from tensorwire.types import MiB

HOST = "127.0.0.1"
PATTERN = 8191  # values are (flat index * 7 + tensor) mod this prime: exact in float32, never all equal


@dataclass(frozen=True)
class World:
    """One gloo world of the benchmark: its name (its store prefix), size and sharded dimension."""

    name: str
    size: int
    dim: int


@dataclass(frozen=True)
class Setup:
    """What every rank holds: ``tensors`` float32 tensors of ``size`` bytes in all, each of
    ``rows`` rows (a rank of a ``Shard(1)`` world reads one byte range per row of each tensor)."""

    size: int = 512 * MiB
    tensors: int = 8
    rows: int = 256
    timeout: float = 300.0
    transport: str = "shm"  # the ranks' way to the server: shm:// (same host: the default) or tcp://

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.size // self.tensors // 4 // self.rows

    @property
    def nbytes(self) -> int:
        rows, cols = self.shape
        return self.tensors * rows * cols * 4

    def check(self, *worlds: World) -> None:
        rows, cols = self.shape
        for world in worlds:
            if rows % world.size or cols % world.size or cols == 0:
                raise ValueError(
                    f"tensors of {rows} x {cols} do not split evenly over {world.size} ranks: "
                    f"choose --size and --rows so both dimensions divide by every world's size"
                )


def name(index: int) -> str:
    return f"layer{index}.weight"


def expected(setup: Setup, index: int, local: tuple[slice, slice]) -> torch.Tensor:
    """The pattern's values of tensor ``index`` on the rows and columns of ``local``."""
    cols = setup.shape[1]
    rows = torch.arange(local[0].start, local[0].stop, dtype=torch.int64)[:, None]
    columns = torch.arange(local[1].start, local[1].stop, dtype=torch.int64)[None, :]
    return (((rows * cols + columns) * 7 + index) % PATTERN).to(torch.float32)


class Rank:
    """One rank's state, client and collectives; ``handle`` answers the parent's requests."""

    def __init__(self, world: World, setup: Setup, url: str) -> None:
        self.world, self.setup = world, setup
        self.rank = dist.get_rank()
        self.mesh = init_device_mesh("cpu", (world.size,))
        self.region = _region(setup.shape, world.dim, world.size, self.rank)
        self.state = {name(i): self._filled(i) for i in range(setup.tensors)}
        self.client: Client = connect(url, timeout=setup.timeout)
        # DCP through tensorwire.dcp: one writer and one reader kept across saves, as a job keeps
        # them (dcp.save(checkpoint_id=...) resets the writer to each new id); clients opened lazily
        self.writer = StorageWriter(url, "reshard/unused", timeout=setup.timeout)
        self.reader = StorageReader(url, "reshard/unused", timeout=setup.timeout)

    def handle(self, request: object) -> object:
        assert isinstance(request, tuple)
        op, *args = request
        return OPS[op](self, *args)

    def close(self) -> None:
        self.writer.close()
        self.reader.close()
        self.client.close()
        dist.destroy_process_group()

    # -- what it holds -------------------------------------------------------------------------
    def _filled(self, index: int) -> DTensor:
        local = expected(self.setup, index, self.region).contiguous()
        shape, stride = torch.Size(self.setup.shape), (self.setup.shape[1], 1)
        placements = [Shard(self.world.dim)]
        return DTensor.from_local(local, self.mesh, placements, run_check=False, shape=shape, stride=stride)

    def _clear(self) -> None:
        for tensor in self.state.values():
            tensor.to_local().zero_()

    def _verify(self, what: str) -> None:
        for i in range(self.setup.tensors):
            if not torch.equal(self.state[name(i)].to_local(), expected(self.setup, i, self.region)):
                where = f"rank {self.rank} of world {self.world.name}"
                raise RuntimeError(f"{what}: {where} holds wrong values of {name(i)}")

    def _timed(self, work: Callable[[], object]) -> float:
        dist.barrier()
        started = time.perf_counter()
        work()
        dist.barrier()
        return time.perf_counter() - started

    # -- the requests ----------------------------------------------------------------------------
    def tw_put(self, prefix: str) -> dict[str, Any]:
        before = self.client.segment_bytes
        seconds = self._timed(lambda: sharded.put_state_dict(self.client, prefix, self.state,
                                                             timeout=self.setup.timeout))  # fmt: skip
        return {"s": seconds, "copied": self.client.segment_bytes - before}

    def tw_get(self, prefix: str) -> dict[str, Any]:
        self._clear()
        before = self.client.segment_bytes
        seconds = self._timed(lambda: sharded.load_state_dict(self.client, prefix, self.state))
        self._verify(f"load_state_dict of {prefix}")
        return {"s": seconds, "copied": self.client.segment_bytes - before}

    def dcp_save(self, directory: str) -> dict[str, Any]:
        return {"s": self._timed(lambda: dcp_save(self.state, checkpoint_id=directory))}

    def dcp_load(self, directory: str) -> dict[str, Any]:
        self._clear()
        seconds = self._timed(lambda: dcp_load(self.state, checkpoint_id=directory))
        self._verify(f"dcp.load of {directory}")
        if self.rank == 0:
            shutil.rmtree(Path(directory))  # read by every rank (the barrier above): tmpfs is memory
        return {"s": seconds}

    def dcp_tw_save(self, checkpoint_id: str) -> dict[str, Any]:
        seconds = self._timed(
            lambda: dcp_save(self.state, checkpoint_id=checkpoint_id, storage_writer=self.writer)
        )
        return {"s": seconds, "generation": self.writer.generation.number if self.writer.generation else 0}

    def dcp_tw_load(self, checkpoint_id: str) -> dict[str, Any]:
        self._clear()
        seconds = self._timed(
            lambda: dcp_load(self.state, checkpoint_id=checkpoint_id, storage_reader=self.reader)
        )
        self._verify(f"dcp.load of {checkpoint_id} through tensorwire.dcp")
        return {"s": seconds}

    def async_save(self, prefix: str) -> dict[str, Any]:
        """A warm-up save (buffers made, group made), then one timed while a training-like loop
        runs until it is committed, then a synchronous put of the same state."""
        with AsyncSaver(timeout=self.setup.timeout) as saver:
            first = saver.save(self.client, prefix, self.state)
            first.result(self.setup.timeout)
            first_blocked = saver.blocked_s
            dist.barrier()
            started = time.perf_counter()
            future = saver.save(self.client, prefix, self.state)
            blocked = saver.blocked_s
            steps = _train_until(future.done, self.setup.timeout)
            generation = future.result(self.setup.timeout)
            committed = time.perf_counter() - started
        sync = self.tw_put(prefix)["s"]
        return {"blocked_s": blocked, "first_blocked_s": first_blocked, "commit_s": committed,
                "steps_during_upload": steps, "sync_s": sync, "generation": generation.number}  # fmt: skip


OPS: dict[str, Callable[..., object]] = {
    "tw_put": Rank.tw_put,
    "tw_get": Rank.tw_get,
    "dcp_save": Rank.dcp_save,
    "dcp_load": Rank.dcp_load,
    "dcp_tw_save": Rank.dcp_tw_save,
    "dcp_tw_load": Rank.dcp_tw_load,
    "async_save": Rank.async_save,
}


def _train_until(done: Callable[[], bool], timeout: float) -> int:
    """Training-like steps (a small matmul each) until ``done()``; how many ran."""
    weight, x = torch.randn(256, 256), torch.randn(64, 256)
    deadline = time.monotonic() + timeout
    steps = 0
    while not done() and time.monotonic() < deadline:
        x = torch.tanh(x @ weight)
        steps += 1
    return steps


def _region(shape: tuple[int, int], dim: int, world: int, rank: int) -> tuple[slice, slice]:
    """The rows and columns rank ``rank`` holds under ``Shard(dim)`` over ``world`` ranks (sizes
    divide evenly: ``Setup.check``)."""
    per = shape[dim] // world
    part = slice(rank * per, (rank + 1) * per)
    return (part, slice(0, shape[1])) if dim == 0 else (slice(0, shape[0]), part)


@dataclass(frozen=True)
class Place:
    """Where a rank process stands: its world, its rank in it, the parent's TCPStore port (the
    gloo rendezvous) and the tensorwire server's URL."""

    world: World
    rank: int
    store_port: int
    url: str


def rank_main(conn: Connection, place: Place, setup: Setup) -> None:
    """A child: one rank of ``place.world`` (the module docstring has its lifecycle)."""
    with starting(conn):
        torch.set_num_threads(1)  # the ranks share the machine's cores
        timeout = timedelta(seconds=setup.timeout)
        store = dist.TCPStore(HOST, place.store_port, is_master=False, timeout=timeout)  # type: ignore[attr-defined]
        world = dist.PrefixStore(place.world.name, store)  # type: ignore[attr-defined]
        dist.init_process_group(
            "gloo", store=world, rank=place.rank, world_size=place.world.size, timeout=timeout
        )
        me = Rank(place.world, setup, place.url)
        conn.send(("ready", place.rank))
    try:
        serve_requests(conn, me.handle)
    finally:
        me.close()
