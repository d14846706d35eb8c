"""The main job: an MLP trained on scikit-learn's handwritten digits through the parameter server.

The data set ships inside scikit-learn (1,797 8x8 images, no download). 80% trains, 20% tests,
split once with a fixed seed; the pixels are scaled by the training set's mean and spread. Worker
r of W takes every W-th training row starting at r, and shuffles its rows each epoch.

Run one worker: ``RANK=0 WORLD_SIZE=2 TENSORWIRE_SERVERS=tcp://... python -m tensorwire.ps.digits``
(``tensorwire demo`` starts the servers and the workers for you).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tensorwire.ps.optim import Adam
from tensorwire.ps.worker.rendezvous import env_int
from tensorwire.ps.worker.worker import Worker, pull_parameters

SEED = 0


class Digits(NamedTuple):
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@dataclass(frozen=True)
class TrainConfig:
    mode: str = "async"
    epochs: int = 12
    batch: int = 32
    lr: float = 3e-3
    timeout: float = 120.0
    push_codec: str | None = None  # e.g. "topk:0.01+fp16" (tensorwire.compression)
    pull_codec: str | None = None  # "int8", "bf16" or "fp16"
    error_feedback: bool | None = None  # None: on for a lossy push codec


@dataclass
class WorkerReport:
    rank: int
    steps: int
    samples: int
    seconds: float
    bytes_pushed: int
    bytes_pulled: int
    max_staleness: int


def load(test_fraction: float = 0.2) -> Digits:
    """The digits, split and scaled (the same on every call and every machine)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED))
    n_test = int(len(x) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-3)
    return Digits((x[train] - mean) / std, y[train], (x[test] - mean) / std, y[test])


def make_model() -> torch.nn.Module:
    """64 pixels -> 128 -> 64 -> 10 classes; the same initial weights in every process."""
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def evaluate(servers: list[str] | str, timeout: float = 60.0) -> float:
    """Test accuracy of the servers' parameters (full precision, whatever the workers pulled)."""
    model = make_model()
    pull_parameters(model, servers, timeout=timeout)
    data = load()
    return accuracy(model, data.x_test, data.y_test)


def train_worker(
    servers: list[str] | str | None,
    config: TrainConfig,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> WorkerReport:
    """Train this worker's share of the digits through the servers; ``on_step(done, total)``."""
    data = load()
    model = make_model()
    optimizer = Adam(lr=config.lr)
    with Worker(model, servers, config.mode, optimizer, rank=rank, world_size=world_size,
                timeout=config.timeout, push_codec=config.push_codec, pull_codec=config.pull_codec,
                error_feedback=config.error_feedback) as worker:  # fmt: skip
        x, y = data.x_train[worker.rank :: worker.world_size], data.y_train[worker.rank :: worker.world_size]
        batches = -(-len(x) // config.batch)
        total, steps, staleness = config.epochs * batches, 0, 0
        start = time.perf_counter()
        for epoch in range(config.epochs):
            order = torch.randperm(
                len(x), generator=torch.Generator().manual_seed(SEED + 1000 * epoch + worker.rank)
            )
            for i in range(batches):
                rows = order[i * config.batch : (i + 1) * config.batch]
                loss: torch.Tensor = F.cross_entropy(model(x[rows]), y[rows])
                loss.backward()  # type: ignore[no-untyped-call]
                staleness = max(staleness, worker.step().staleness)
                steps += 1
                if on_step is not None:
                    on_step(steps, total)
        seconds = time.perf_counter() - start
        return WorkerReport(worker.rank, steps, config.epochs * len(x), seconds, worker.bytes_pushed,
                            worker.bytes_pulled, staleness)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--servers", help="comma-separated URLs (default: $TENSORWIRE_SERVERS)")
    parser.add_argument("--mode", default=TrainConfig.mode)
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    parser.add_argument("--batch", type=int, default=TrainConfig.batch)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--push-codec", help="compress gradients: fp16, bf16, int8, topk:0.01+fp16, sign ...")
    parser.add_argument("--pull-codec", help="pull the weights quantised: int8, bf16 or fp16")
    parser.add_argument("--no-error-feedback", action="store_true", help="with a lossy --push-codec")
    parser.add_argument("--report", help="write this worker's report here (JSON; {rank} is replaced)")
    parser.add_argument("--progress", action="store_true", help="show a progress bar (on rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # several processes share a few cores
    feedback = False if args.no_error_feedback else None
    config = TrainConfig(args.mode, args.epochs, args.batch, args.lr, push_codec=args.push_codec,
                         pull_codec=args.pull_codec, error_feedback=feedback)  # fmt: skip
    rank = env_int("RANK", None, 0)
    run = _with_progress if args.progress and rank == 0 else train_worker
    report = run(args.servers, config)
    if args.report is not None:
        Path(args.report.format(rank=rank)).write_text(json.dumps(asdict(report)))


def _with_progress(servers: str | None, config: TrainConfig) -> WorkerReport:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("training ({task.description})", markup=False),  # the mode is the user's text
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task(f"{config.mode}, worker 0's steps", total=None)

        def on_step(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        return train_worker(servers, config, on_step=on_step)


if __name__ == "__main__":
    main()
