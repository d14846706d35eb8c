"""An FSDP2 job on 4 ranks checkpoints asynchronously every few steps; a job on 2 ranks resumes
from one of those checkpoints and its losses match the uninterrupted run's within 1e-6.

Real processes (spawned, gloo over loopback, rendezvous through a TCPStore on port 0 of this
process), a real tensorwire server (a thread of this process, port 0). The model is float64 and
every step's global batch is fixed and split evenly over the ranks, so every world size computes
the same mean loss: what differs between the two runs is only where the state lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tensorwire
from tensorwire import sharded
from tensorwire.bench.ps_baselines import run_children
from tensorwire.server import ServerThread
from tensorwire.sharded.checkpoint import AsyncSaver, load_training_state, training_state
from tensorwire.store.generations import GenerationConfig

HOST = "127.0.0.1"
PREFIX = "fsdp/ckpt"
RESUME_AT, EVERY, AFTER = 6, 3, 4  # resume from the checkpoint of step 6; one every 3 steps; 4 more
GLOBAL_BATCH = 16
TIMEOUT = 60.0


# -- one rank (a spawned child) --------------------------------------------------------------------
@dataclass(frozen=True)
class Rank:
    """Where a rank process stands: its rank, its world's size, the test's TCPStore port (the gloo
    rendezvous) and the tensorwire server's URL."""

    rank: int
    world: int
    store_port: int
    url: str

    def join(self) -> None:
        timeout = timedelta(seconds=TIMEOUT)
        store = dist.TCPStore(HOST, self.store_port, is_master=False, timeout=timeout)
        world = dist.PrefixStore(f"world{self.world}", store)  # two jobs, one store
        dist.init_process_group("gloo", store=world, rank=self.rank, world_size=self.world, timeout=timeout)


def _model_and_optimizer(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank and in every world
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).double()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, me: Rank) -> float:
    """One training step on this rank's slice of the step's global batch; the global mean loss."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 12, generator=gen, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, 8, generator=gen, dtype=torch.float64)
    per = GLOBAL_BATCH // me.world
    mine = slice(me.rank * per, (me.rank + 1) * per)
    loss = F.mse_loss(model(x[mine]), y[mine])
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / me.world


def train_and_save(me: Rank, steps: int) -> dict[str, Any]:
    """The uninterrupted run, with an async save every EVERY steps: its losses and, per saved
    step, the generation its save committed."""
    me.join()
    model, optimizer = _model_and_optimizer(me.world)
    losses, saves = [], {}
    with tensorwire.connect(me.url, timeout=TIMEOUT) as client, AsyncSaver(timeout=TIMEOUT) as saver:
        for step in range(steps):
            losses.append(_step(model, optimizer, step, me))
            if (step + 1) % EVERY == 0:
                saves[step + 1] = saver.save(client, PREFIX, training_state(model, optimizer))
        committed = {done: future.result(TIMEOUT).number for done, future in saves.items()}
    dist.destroy_process_group()
    return {"losses": losses, "committed": committed}


def resume(me: Rank, at: int, start: int, steps: int) -> list[float]:
    """A fresh job loads generation ``at`` (the state after ``start`` steps) into its own layout
    and trains ``steps`` more; its losses."""
    me.join()
    model, optimizer = _model_and_optimizer(me.world)
    state = training_state(model, optimizer)
    with tensorwire.connect(me.url, timeout=TIMEOUT) as client:
        sharded.get_state_dict(client, PREFIX, state, at=at)
    load_training_state(model, optimizer, state)
    losses = [_step(model, optimizer, step, me) for step in range(start, start + steps)]
    dist.destroy_process_group()
    return losses


# -- the test --------------------------------------------------------------------------------------
def test_fsdp_job_resumes_on_another_world_size_from_an_async_checkpoint() -> None:
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    steps = RESUME_AT + AFTER
    keep = GenerationConfig(keep=steps // EVERY + 1)  # the checkpoint of RESUME_AT stays readable
    with ServerThread([f"tcp://{HOST}:0"], generations=keep) as server:
        ranks = [Rank(r, 4, store.port, server.url) for r in range(4)]
        four = run_children(
            "4-rank FSDP job", [(f"rank {me.rank}", train_and_save, (me, steps)) for me in ranks], 120
        )
        runs = [r for r in four if isinstance(r, dict)]
        committed = runs[0]["committed"]
        assert all(run["committed"] == committed for run in runs)  # every rank: the same generations
        assert sorted(committed) == [3, 6, 9] and sorted(committed.values()) == list(committed.values())
        ranks = [Rank(r, 2, store.port, server.url) for r in range(2)]
        jobs = [
            (f"rank {me.rank} of 2", resume, (me, committed[RESUME_AT], RESUME_AT, AFTER)) for me in ranks
        ]
        two = run_children("2-rank FSDP job", jobs, 120)
    reference = runs[0]["losses"][RESUME_AT:]
    for resumed in two:
        assert isinstance(resumed, list) and len(resumed) == AFTER
        for step, (want, got) in enumerate(zip(reference, resumed, strict=True), start=RESUME_AT):
            assert abs(want - got) <= 1e-6, f"step {step}: {got} after resuming, {want} uninterrupted"
    assert runs[0]["losses"][RESUME_AT] < runs[0]["losses"][0]  # it trains: the comparison means something
