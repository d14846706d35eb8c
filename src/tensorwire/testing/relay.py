"""A relay origin for tests (``origin``: a server with a ``RelayCoordinator`` and small chunks, so that
a transfer is many chunks and a fault lands mid-transfer), a model's tensors, bit-exact checks, and
where a tensor's memory lies (``segment_mapping``: a view of a shared-memory segment, or a copy)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

import tensorwire
from tensorwire.broadcast import Chains, RelayCoordinator
from tensorwire.broadcast.source import StoreSource
from tensorwire.security import Security
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.store.generations import GenerationConfig
from tensorwire.wire import shm as ws

PREFIX = "policy/"
CHUNK = 16 << 10  # small: a transfer is many chunks, so faults land mid-transfer


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "fc1.weight": torch.randn(256, 300, generator=gen),  # 300 KiB: 19 chunks
        "fc1.bias": torch.randn(256, generator=gen).to(torch.bfloat16),
        "fc2.weight": torch.randn(64, 256, generator=gen).to(torch.float16),
        "steps": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(1000, generator=gen) > 0.5,
        "empty": torch.empty(0),
    }


def blank_like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in tensors.items()}


def model_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(v.nbytes for v in tensors.values())


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a
    )


def segment_mapping(tensor: torch.Tensor) -> str | None:
    """The permissions ("r--s": read-only, shared) of the mapping of a tensorwire segment that
    ``tensor``'s memory lies in, or None when it lies in none (a private copy)."""
    segments = str(ws.shm_dir() / ws.PREFIX)
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith(segments):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                if low <= tensor.data_ptr() < high:
                    return fields[1]
    return None


@contextmanager
def origin(
    token: str | None = None, chains: Chains | None = None, *, generations: bool = False, keep: int = 2
) -> Iterator[tuple[ServerThread, RelayCoordinator]]:
    """A server whose coordinator relays its plain versioned tensors in CHUNK-byte chunks, or (with
    ``generations``) its published generations, as ``tensorwire serve`` does; it keeps the last
    ``keep`` generations of a prefix."""
    store = TensorStore()
    config = GenerationConfig(keep=keep)
    with ServerThread(store=store, security=Security(token=token), generations=config) as srv:
        if generations:
            coordinator = RelayCoordinator.of(srv.server, chains)
        else:
            coordinator = RelayCoordinator(StoreSource(store, chunk_bytes=CHUNK), chains)
            srv.server.extend(coordinator)
        yield srv, coordinator


def publish(url: str, tensors: dict[str, torch.Tensor], token: str | None = None) -> int:
    with tensorwire.connect(url, token=token) as client:
        return client.put_many({PREFIX + k: v for k, v in tensors.items()})


@contextmanager
def subscribers(
    url: str, prefix: str, targets: list[dict[str, torch.Tensor]], **options: Any
) -> Iterator[list[tensorwire.Subscriber]]:
    """One ``Subscriber`` per target on loopback (``options``: its keyword arguments), all closed
    on the way out."""
    subs: list[tensorwire.Subscriber] = []
    try:
        for target in targets:
            subs.append(tensorwire.Subscriber(url, prefix, target, listen_host="127.0.0.1", **options))
        yield subs
    finally:
        for sub in subs:
            sub.close()
