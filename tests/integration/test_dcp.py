"""torch.distributed.checkpoint through ``tensorwire.dcp``, with real rank processes (spawned, gloo
over loopback, rendezvous under a prefix of one TCPStore on port 0 of this process) and a real
tensorwire server (a thread of this process, port 0, a token): DTensor state (Shard(0), Shard(1),
Replicate; float32, bfloat16, int64; an uneven split that leaves a rank an empty shard), a plain
tensor and non-tensor values (DCP's byte items) saved from 4 ranks, ``dcp.save`` and
``dcp.async_save``, loaded on 2 and on 3 ranks through DCP's own planner, bit for bit; a rank
SIGKILLed in the middle of a save leaves nothing of it and the previous checkpoint loadable; two
saves under one checkpoint id never mix. At most 4 rank processes at a time; every one gone when
``run_children`` returns.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from sharded_kit import same_bits  # tests/integration: the spawned ranks find it as the test did
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import tensorwire
from tensorwire.bench.ps_baselines import Job, run_children
from tensorwire.dcp import StorageReader, StorageWriter
from tensorwire.errors import CheckpointConflict
from tensorwire.server.options import ServerOptions
from tensorwire.testing.process import wait_for

HOST = "127.0.0.1"
TOKEN = "dcp-integration"
TIMEOUT = 60.0
# name -> global shape, dtype, placement over a 1-D mesh of the job's ranks
PARAMS: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {
    "layer.w": ((8, 6), torch.float32, "S0"),
    "layer.v": ((7, 5), torch.bfloat16, "S1"),  # 5 columns on 4 ranks: the last holds none
    "layer.ids": ((3, 4), torch.int64, "R"),
}


def full(name: str, seed: int) -> torch.Tensor:
    shape, dtype, _ = PARAMS.get(name, ((5,), torch.float64, ""))
    gen = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, name)))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(1 << 40), 1 << 40, shape, generator=gen, dtype=dtype)


def extras(seed: int) -> dict[str, Any]:
    """What DCP stores as byte items: not tensors."""
    return {"step": seed * 10, "lr": [0.1 * seed, 0.01], "name": f"seed{seed}"}


def blank_extras() -> dict[str, Any]:
    """What a load fills with ``extras``: DCP matches nested dicts key by key (flattened)."""
    return {"step": -1, "lr": None, "name": None}


# -- one rank (a spawned child) --------------------------------------------------------------------
@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    store_port: int
    url: str
    job: str  # the rendezvous prefix: jobs of one test share the TCPStore

    def join(self) -> None:
        timeout = timedelta(seconds=TIMEOUT)
        store = dist.TCPStore(HOST, self.store_port, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(self.job, store)
        dist.init_process_group(
            "gloo", store=prefixed, rank=self.rank, world_size=self.world, timeout=timeout
        )

    def state(self, seed: int, *, zeros: bool) -> dict[str, Any]:
        mesh = init_device_mesh("cpu", (self.world,))
        out: dict[str, Any] = {}
        for name, (shape, _, how) in PARAMS.items():
            placement = Replicate() if how == "R" else Shard(int(how[1:]))
            local = full(name, seed)[_index(shape, mesh, placement)].clone()
            if zeros:
                local.zero_()
            out[name] = DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape),
                                           stride=torch.empty(shape).stride())  # fmt: skip
        out["plain"] = torch.zeros(5, dtype=torch.float64) if zeros else full("plain", seed)
        out["extra"] = blank_extras() if zeros else extras(seed)
        return out

    def mismatches(self, state: dict[str, Any], seed: int) -> list[str]:
        bad = []
        for name, (shape, _, _) in PARAMS.items():
            d = state[name]
            want = full(name, seed)[_index(shape, d.device_mesh, d.placements[0])]
            if not same_bits(d.to_local(), want):
                bad.append(name)
        if not same_bits(state["plain"], full("plain", seed)):
            bad.append("plain")
        if state["extra"] != extras(seed):
            bad.append(f"extra: {state['extra']}")
        return bad

    def writer(self, checkpoint_id: str) -> StorageWriter:
        return StorageWriter(self.url, checkpoint_id, token=TOKEN, timeout=TIMEOUT)

    def reader(self, checkpoint_id: str) -> StorageReader:
        return StorageReader(self.url, checkpoint_id, token=TOKEN, timeout=TIMEOUT)


def _index(shape: tuple[int, ...], mesh: Any, placement: Any) -> tuple[slice, ...]:
    local, offsets = compute_local_shape_and_global_offset(shape, mesh, [placement])
    return tuple(slice(o, o + n) for o, n in zip(offsets, local, strict=True))


def load_whole(url: str, checkpoint_id: str, seed: int) -> None:
    """Checkpoint ``checkpoint_id`` read whole in this process (a world of one: also a reshard), and
    checked to hold the state of ``seed``, bit for bit."""
    state: dict[str, Any] = {
        name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype, _) in PARAMS.items()
    }
    state |= {"plain": torch.zeros(5, dtype=torch.float64), "extra": blank_extras()}
    with StorageReader(url, checkpoint_id, token=TOKEN) as reader:
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(same_bits(state[name], full(name, seed)) for name in (*PARAMS, "plain"))
    assert state["extra"] == extras(seed)


def save_job(me: Rank, saves: list[tuple[str, int, str]]) -> dict[str, Any]:
    """Each (checkpoint id, seed, "sync" | "async") saved in turn; each writer pickled after its
    save (what DCP's process-based async_save does to it) must not carry its connection."""
    me.join()
    numbers: dict[str, int] = {}
    for checkpoint_id, seed, how in saves:
        writer = me.writer(checkpoint_id)
        state = me.state(seed, zeros=False)
        if how == "async":
            future = dcp.async_save(state, storage_writer=writer)
            future.result(TIMEOUT)  # type: ignore[union-attr]
        else:
            dcp.save(state, storage_writer=writer)
        numbers[checkpoint_id] = writer.generation.number if writer.generation else 0
        copy = pickle.loads(pickle.dumps(writer))
        assert copy._conn._client is None and copy._pending is None and copy.prefix == writer.prefix
        writer.close()
    dist.destroy_process_group()
    return {"rank": me.rank, "generations": numbers}


def load_job(me: Rank, loads: list[tuple[str, int]]) -> dict[str, list[str]]:
    """Each (checkpoint id, seed) loaded into this world's layout; what differs, per id."""
    me.join()
    out = {}
    for checkpoint_id, seed in loads:
        state = me.state(0, zeros=True)
        with me.reader(checkpoint_id) as reader:
            dcp.load(state, storage_reader=reader)
        out[checkpoint_id] = me.mismatches(state, seed)
    dist.destroy_process_group()
    return out


class _KilledMidSave(StorageWriter):
    """A rank that dies (SIGKILL) once its part is on its way: after ``write_data`` started it."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        os.kill(os.getpid(), signal.SIGKILL)
        return future


def kill_job(me: Rank, victim: int) -> str:
    """Checkpoint "good" saved whole; then "doomed", whose rank ``victim`` is killed mid-save."""
    me.join()
    dcp.save(me.state(1, zeros=False), storage_writer=me.writer("good"))
    dist.barrier()
    cls = _KilledMidSave if me.rank == victim else StorageWriter
    try:
        dcp.save(me.state(2, zeros=False), storage_writer=cls(me.url, "doomed", token=TOKEN, timeout=TIMEOUT))
    except BaseException as exc:  # the survivors hear of the dead rank (gloo), or are killed
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return "saved"


# -- the tests -------------------------------------------------------------------------------------
@pytest.fixture
def server() -> Any:
    with tensorwire.ServerThread([f"tcp://{HOST}:0"], ServerOptions(token=TOKEN),
                                 store=tensorwire.TensorStore(256 << 20)) as srv:  # fmt: skip
        yield srv


@pytest.fixture
def store() -> Any:
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)


def _ranks(n: int, store: Any, url: str, job: str) -> list[Rank]:
    return [Rank(r, n, store.port, url, job) for r in range(n)]


def test_saved_on_4_ranks_loads_on_2_and_on_3_bit_for_bit(server: Any, store: Any) -> None:
    savers: list[Job] = [(f"saver {me.rank}", save_job, (me, [("a", 1, "sync"), ("b", 2, "async")]))
                         for me in _ranks(4, store, server.url, "save4")]  # fmt: skip
    saved = run_children("4 ranks save", savers, 120)
    assert [s["generations"] for s in saved] == [{"a": 1, "b": 1}] + [{"a": 0, "b": 0}] * 3  # type: ignore[index]
    for world in (2, 3):
        loads: list[Job] = [(f"loader {me.rank} of {world}", load_job, (me, [("a", 1), ("b", 2)]))
                            for me in _ranks(world, store, server.url, f"load{world}")]  # fmt: skip
        for answer in run_children(f"{world} ranks load", loads, 120):
            assert answer == {"a": [], "b": []}
    # one process, the whole state: a world of 1 reads every chunk, also a reshard
    load_whole(server.url, "b", 2)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(server: Any, store: Any) -> None:
    jobs: list[Job] = [(f"rank {me.rank}", kill_job, (me, 3)) for me in _ranks(4, store, server.url, "kill")]
    with pytest.raises(RuntimeError, match="rank 3"):  # it died; the others are reaped
        run_children("a save whose rank 3 dies", jobs, 120)
    parts = server.server.generation_ops.parts
    wait_for(lambda: not parts.open, TIMEOUT, "the dead rank's save to be aborted")
    with (
        StorageReader(server.url, "doomed", token=TOKEN) as reader,
        pytest.raises(CheckpointException) as caught,
    ):
        dcp.load({"plain": torch.zeros(5, dtype=torch.float64)}, storage_reader=reader, no_dist=True)
    assert "no committed metadata" in str(caught.value)
    load_whole(server.url, "good", 1)


def test_two_saves_under_one_checkpoint_id_never_mix(server: Any) -> None:
    """Save B reserves "x" and waits while save A takes it whole; B's commit, generation 2, is
    refused and never read; a third save under "x" is refused before it writes. Both in this
    process (DCP without a process group), A's and B's items under the same keys."""
    first = {"w": torch.full((4, 4), 1.0), "meta": {"by": "A"}}
    second = {"w": torch.full((4, 4), 2.0), "meta": {"by": "B"}}
    reserved, taken = threading.Event(), threading.Event()

    class Late(StorageWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            reserved.set()
            assert taken.wait(TIMEOUT)
            return super().write_data(plan, planner)

    outcome: list[BaseException] = []

    def save_b() -> None:
        try:
            dcp.save(second, storage_writer=Late(server.url, "x", token=TOKEN), no_dist=True)
        except BaseException as exc:
            outcome.append(exc)

    b = threading.Thread(target=save_b)
    b.start()
    try:
        assert reserved.wait(TIMEOUT)
        with StorageWriter(server.url, "x", token=TOKEN) as writer:
            dcp.save(first, storage_writer=writer, no_dist=True)
            assert writer.generation is not None and writer.generation.number == 1
    finally:
        taken.set()
        b.join(TIMEOUT)
    assert len(outcome) == 1 and isinstance(outcome[0], CheckpointException)
    assert any(isinstance(e, CheckpointConflict) for e, _ in outcome[0].failures.values())
    with (
        StorageWriter(server.url, "x", token=TOKEN) as again,
        pytest.raises(CheckpointException, match="already exists"),
    ):
        dcp.save(second, storage_writer=again, no_dist=True)
    state: dict[str, Any] = {"w": torch.zeros(4, 4), "meta": {"by": None}}
    with StorageReader(server.url, "x", token=TOKEN) as reader:
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert torch.equal(state["w"], first["w"]) and state["meta"] == {"by": "A"}


PROCESS_SAVE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from tensorwire.dcp import StorageWriter
    url, port = sys.argv[1], sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    writer = StorageWriter(url, "proc", token=sys.argv[3])
    writer.close()  # used once here: its copy in DCP's checkpoint process connects on its own
    future = dcp.async_save({"w": torch.arange(12.0)}, storage_writer=writer,
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    future.result(60)
    print("saved")
    os._exit(0)
""")


def test_process_based_async_save_sends_the_writer_to_its_checkpoint_process(
    server: Any, tmp_path: Path
) -> None:
    """DCP's process-based async_save pickles the writer into its own checkpoint process (which
    starts its own gloo world): the writer connects there lazily and the save commits."""
    probe = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    port = str(probe.port)
    del probe  # a free port for the one-rank world's rendezvous
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", PROCESS_SAVE, server.url, port, TOKEN], env=env, check=False,
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0 and "saved" in done.stdout, done.stderr[-3000:]
    state = {"w": torch.zeros(12)}
    with StorageReader(server.url, "proc", token=TOKEN) as reader:
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert torch.equal(state["w"], torch.arange(12.0))
