"""Generations on a ``--data-dir`` server survive its end, as committed puts do (issue 32, class 6):
a real ``tensorwire serve`` process is killed with SIGKILL (or stopped with SIGTERM) once a publish
has returned, started again on the same directory, and every generation kept reads back with its
number, its manifest and root digest, and every tensor bit for bit; "latest", retention, waits and
leases go on from there. A sharded ``put_state_dict`` (a multi-part publish) and an async save
survive the same way; a dropped prefix stays dropped."""

from __future__ import annotations

import concurrent.futures
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import tensorwire
from tensorwire import sharded
from tensorwire.errors import GenerationRetired, InvalidTensor, KeyNotFound, WaitTimeout
from tensorwire.sharded.checkpoint import AsyncSaver
from tensorwire.testing.process import ServerProcess
from tensorwire.types import GenerationManifest


def tensors(g: int) -> dict[str, torch.Tensor]:
    """Generation ``g``: dtypes written natively and as raw bytes, a 0-dim and an empty tensor, and
    one of more than one 4 MiB checksum chunk."""
    gen = torch.Generator().manual_seed(g)
    return {
        "w": torch.randn(64, 33, generator=gen),
        "bf": torch.randn(17, generator=gen).to(torch.bfloat16),
        "c": torch.randn(5, dtype=torch.complex128, generator=gen),  # no safetensors dtype: raw bytes
        "step": torch.tensor(g, dtype=torch.int64),
        "none": torch.empty(0, 3),
        "big": torch.randint(0, 255, (5 << 20,), dtype=torch.uint8, generator=gen),
    }


@contextmanager
def serving(data_dir: Path, *extra: str) -> Iterator[ServerProcess]:
    srv = ServerProcess(capacity="256MiB", data_dir=data_dir, extra=extra)
    try:
        yield srv
    finally:
        srv.stop()


def end(srv: ServerProcess, how: signal.Signals) -> None:
    """SIGKILL: nothing runs after it; SIGTERM: the server's clean stop."""
    srv.signal(how)
    srv.proc.wait(30)


def check_generation(c: tensorwire.Client, prefix: str, g: int, manifest: GenerationManifest) -> None:
    assert c.manifest(prefix, g) == manifest
    names = [f"{prefix}/{k}" for k in tensors(g)]
    got = c.get_many(names, at=g, verify=True)  # checked against the manifest and its root digest
    for key, want in tensors(g).items():
        read = got[f"{prefix}/{key}"]
        assert read.dtype == want.dtype and read.shape == want.shape
        assert read.reshape(-1).view(torch.uint8).equal(want.reshape(-1).view(torch.uint8)), key


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "clean-stop"])
def test_published_generations_survive_the_end_of_the_server(tmp_path: Path, how: signal.Signals) -> None:
    manifests = {}
    with serving(tmp_path, "--keep-generations", "2") as first, tensorwire.connect(first.url, retries=0) as c:
        for g in (1, 2, 3):
            assert c.publish("model", tensors(g)).number == g
            manifests[g] = c.manifest("model", g)
        lease = c.lease("model", 3, 30)
        assert lease.seconds > 0
        end(first, how)  # right after the publish returned
    with serving(tmp_path, "--keep-generations", "2") as second, tensorwire.connect(second.url) as c:
        assert c.manifest("model").generation.number == 3  # "latest" is the newest that was published
        for g in (2, 3):
            check_generation(c, "model", g, manifests[g])
        with pytest.raises(GenerationRetired, match="the oldest kept is 2"):
            c.manifest("model", 1)
        assert c.wait("model", 2, timeout=5).number == 3  # at once: 3 is there
        with pytest.raises(WaitTimeout):
            c.wait("model", 3, timeout=0.2)
        with c.lease("model", 2, 30):  # leases are the connection's: none survived, new ones work
            assert c.publish("model", tensors(4)).number == 4  # numbering goes on
            check_generation(c, "model", 2, manifests[2])  # leased: kept past --keep-generations
        with pytest.raises(InvalidTensor, match="by its number"):
            c.lease("model", "latest", 30)  # type: ignore[arg-type]


def test_a_retirement_and_a_drop_are_durable_too(tmp_path: Path) -> None:
    with serving(tmp_path, "--keep-generations", "1") as first, tensorwire.connect(first.url) as c:
        for g in (1, 2):
            c.publish("a", tensors(g))
        c.publish("gone", {"x": torch.ones(3)})
        assert c.drop_generations("gone") == 1
        end(first, signal.SIGKILL)
    with serving(tmp_path, "--keep-generations", "1") as second, tensorwire.connect(second.url) as c:
        with pytest.raises(GenerationRetired):
            c.manifest("a", 1)
        assert c.manifest("a").generation.number == 2
        with pytest.raises(KeyNotFound):
            c.manifest("gone")
    homes = list((tmp_path / "generations").iterdir())
    assert len(homes) == 1 and [p.name for p in homes[0].iterdir()] == [f"{2:020d}"]


def test_a_sharded_put_and_an_async_save_survive_a_kill(tmp_path: Path) -> None:
    state = {"layer.w": torch.randn(8, 6), "layer.b": torch.arange(5.0), "step": torch.tensor(7.0)}
    saved = {k: v + 1 for k, v in state.items()}
    with serving(tmp_path) as first, tensorwire.connect(first.url) as c:
        put = sharded.put_state_dict(c, "ckpt", state)
        with AsyncSaver() as saver:
            done = saver.save(c, "async", saved).result(timeout=30)
        # two ranks' parts of one generation, from two connections
        txn = os.urandom(16)
        with tensorwire.connect(first.url) as other, concurrent.futures.ThreadPoolExecutor(1) as pool:
            later = pool.submit(other.publish_part, "two", {"b": torch.ones(4)}, txn=txn, index=1,
                                count=2, timeout=20)  # fmt: skip
            both = c.publish_part("two", {"a": torch.zeros(4)}, txn=txn, index=0, count=2, timeout=20)
            assert later.result(timeout=30) == both
        end(first, signal.SIGKILL)
    with serving(tmp_path) as second, tensorwire.connect(second.url) as c:
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        assert sharded.load_state_dict(c, "ckpt", into) == put
        assert all(torch.equal(into[k], state[k]) for k in state)
        into = {k: torch.zeros_like(v) for k, v in saved.items()}
        assert sharded.load_state_dict(c, "async", into) == done
        assert all(torch.equal(into[k], saved[k]) for k in saved)
        got = c.get_many(["two/a", "two/b"], at=both.number, verify=True)
        assert torch.equal(got["two/a"], torch.zeros(4)) and torch.equal(got["two/b"], torch.ones(4))
