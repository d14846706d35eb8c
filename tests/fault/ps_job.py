"""A parameter-server worker for the fault tests, run as a script:
``python ps_job.py SERVERS MODE STEPS OUT [PULL]`` (RANK and WORLD_SIZE in the environment; PULL:
``direct``, the default, or ``relay``).

Trains a small MLP on data that depends only on (rank, step), so two runs that apply the same
updates end with the same bits. Writes OUT/rank<r>.pt (the parameters) and OUT/rank<r>.json."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from tensorwire.ps import SGD, Worker

_SEEDING = threading.Lock()  # torch's global generator: workers in threads take turns


def model() -> torch.nn.Module:
    with _SEEDING:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)


def train(
    servers: str, mode: str, steps: int, out: Path, *, rank: int = 0, world: int = 1, pull: str = "direct"
) -> dict[str, int]:
    net = model()
    rejoined = 0
    with Worker(net, servers, mode, SGD(lr=0.05, momentum=0.9), rank=rank, world_size=world,
                timeout=60, heartbeat=0.2, pull=pull) as worker:  # fmt: skip
        for step in range(steps):
            x, y = batch(rank, step)
            loss: torch.Tensor = F.cross_entropy(net(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            rejoined += worker.step().rejoined
            # Published by rename: a reader (a fault schedule's condition) never sees it half written.
            (out / f"rank{rank}.progress.tmp").write_text(str(step + 1))
            (out / f"rank{rank}.progress.tmp").replace(out / f"rank{rank}.progress")
        report = {"rejoined": rejoined, "rejoins": worker.rejoins, "clock": worker.clock}
        if worker.relay is not None:
            report |= {"relay_pulls": worker.relay.pulls, "relay_fallbacks": worker.relay.fallbacks}
    torch.save(net.state_dict(), out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    return report


if __name__ == "__main__":
    torch.set_num_threads(1)
    servers, mode, steps, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    pull = sys.argv[5] if len(sys.argv) > 5 else "direct"
    train(servers, mode, steps, out, rank=rank, world=world, pull=pull)
