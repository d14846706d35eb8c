"""An FSDP2 job on 4 ranks checkpoints asynchronously every few steps; a job on 2 ranks resumes
from one of those checkpoints and its losses match the uninterrupted run's within 1e-6.

Real processes, all six started at once (spawned, gloo over loopback, each job's rendezvous
under its own prefix of one TCPStore on port 0 of this process; the 2-rank job waits on the server
for the checkpoint it resumes from), a real tensorwire server (a thread of this process, port 0),
every process gone when ``run_children`` returns. The model is float64 and
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
from tensorwire.bench.ps_baselines import Job, run_children
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions
from tensorwire.sharded.checkpoint import AsyncSaver, load_training_state, training_state
from tensorwire.store.generations import GenerationConfig

HOST = "127.0.0.1"
PREFIX = "fsdp/ckpt"
RESUME_AT, EVERY, AFTER = 6, 3, 4  # resume from the checkpoint of step 6; one every 3 steps; 4 more
GLOBAL_BATCH = 16
TIMEOUT = 60.0
TEACHER = torch.randn(12, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


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
    y = torch.tanh(x @ TEACHER)  # something to learn: the loss falls as it trains
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


def resume(me: Rank, number: int, start: int, steps: int) -> list[float]:
    """A fresh job, started beside the first: once generation ``number`` (the state after ``start``
    steps) is committed, it loads it into its own layout and trains ``steps`` more; its losses."""
    me.join()
    model, optimizer = _model_and_optimizer(me.world)
    state = training_state(model, optimizer)
    with tensorwire.connect(me.url, timeout=TIMEOUT) as client:
        client.wait(PREFIX, after=number - 1, timeout=TIMEOUT)  # the server answers once it exists
        sharded.load_state_dict(client, PREFIX, state, at=number)
    load_training_state(model, optimizer, state)
    losses = [_step(model, optimizer, step, me) for step in range(start, start + steps)]
    dist.destroy_process_group()
    return losses


# -- the test --------------------------------------------------------------------------------------
def test_fsdp_job_resumes_on_another_world_size_from_an_async_checkpoint() -> None:
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    steps = RESUME_AT + AFTER
    number = RESUME_AT // EVERY  # generations count 1, 2, ... on a fresh server: the save of step 6
    keep = GenerationConfig(keep=steps // EVERY + 1)  # the checkpoint of RESUME_AT stays readable
    with ServerThread([f"tcp://{HOST}:0"], ServerOptions(generations=keep)) as server:
        four = [Rank(r, 4, store.port, server.url) for r in range(4)]
        two = [Rank(r, 2, store.port, server.url) for r in range(2)]
        jobs: list[Job] = [(f"rank {me.rank} of 4", train_and_save, (me, steps)) for me in four]
        jobs += [(f"rank {me.rank} of 2", resume, (me, number, RESUME_AT, AFTER)) for me in two]
        results = run_children("FSDP jobs on 4 and 2 ranks", jobs, 120)  # both start at once
    runs = [r for r in results[:4] if isinstance(r, dict)]
    committed = runs[0]["committed"]
    assert all(run["committed"] == committed for run in runs)  # every rank: the same generations
    assert committed == {3: 1, 6: 2, 9: 3} and committed[RESUME_AT] == number
    losses = runs[0]["losses"]
    for resumed in results[4:]:
        assert isinstance(resumed, list) and len(resumed) == AFTER
        for step, (want, got) in enumerate(zip(losses[RESUME_AT:], resumed, strict=True), start=RESUME_AT):
            assert abs(want - got) <= 1e-6, f"step {step}: {got} after resuming, {want} uninterrupted"
    assert losses[RESUME_AT] < 0.75 * losses[0]  # it learns: a model that lost its state would show
