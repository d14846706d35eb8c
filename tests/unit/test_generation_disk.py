"""Generations in a data directory without a network (store/generation_disk.py): what a crash
leaves half-written is deleted at start, generations retired before a crash are trimmed at start,
and damaged files are a PersistenceError at start, never a silent loss or a wrong read."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tensorwire.errors import GenerationRetired, PersistenceError
from tensorwire.store import TensorStore
from tensorwire.store.generation_disk import ROOT, number_dir, prefix_dir
from tensorwire.store.generations import GenerationConfig, Generations
from tensorwire.types import TensorMeta
from tensorwire.wire import generations as wg


def opened(path: Path, keep: int = 2) -> Generations:
    return Generations(TensorStore(capacity=64 << 20, data_dir=path), GenerationConfig(keep=keep))


def publish(gens: Generations, prefix: str, value: float) -> int:
    meta = TensorMeta(f"{prefix}/w", torch.float32, (4,), 16)
    res = gens.store.reserve([meta])
    res.buffers[0].cast("B")[:] = torch.full((4,), float(value)).numpy().tobytes()
    sums = [wg.chunk_checksums(res.buffers[0])]
    return asyncio.run(gens.publish_durable(prefix, res, sums)).number


def test_generations_come_back_numbered_as_they_were_and_beyond_keep_they_go(tmp_path: Path) -> None:
    gens = opened(tmp_path, keep=3)
    assert [publish(gens, "p", g) for g in (1, 2, 3)] == [1, 2, 3]
    digest = gens.find("p", 3).generation.digest
    back = opened(tmp_path, keep=2)  # a restart with a smaller --keep-generations
    assert back.find("p", wg.LATEST).generation.number == 3
    assert back.find("p", 3).generation.digest == digest
    with pytest.raises(GenerationRetired):
        back.find("p", 1)
    home = tmp_path / ROOT / prefix_dir("p")
    assert sorted(p.name for p in home.iterdir()) == [number_dir(2), number_dir(3)]


def test_what_a_crash_left_half_written_is_deleted_at_start(tmp_path: Path) -> None:
    gens = opened(tmp_path)
    publish(gens, "p", 1)
    home = tmp_path / ROOT / prefix_dir("p")
    (home / ".tmp-deadbeef").mkdir()  # a write that never finished
    (home / ".tmp-deadbeef" / "x.safetensors").write_bytes(b"half")
    (tmp_path / ROOT / ".tmp-cafe").mkdir()  # a prefix being removed
    back = opened(tmp_path)
    assert back.find("p", 1).generation.number == 1
    assert [p.name for p in home.iterdir()] == [number_dir(1)]
    assert [p.name for p in (tmp_path / ROOT).iterdir()] == [prefix_dir("p")]


def test_a_damaged_generation_is_refused_at_start(tmp_path: Path) -> None:
    gens = opened(tmp_path)
    publish(gens, "p", 1)
    directory = tmp_path / ROOT / prefix_dir("p") / number_dir(1)
    tensor = next(p for p in directory.iterdir() if p.suffix == ".safetensors")
    raw = bytearray(tensor.read_bytes())
    raw[-1] ^= 0xFF  # one bit of its bytes
    tensor.write_bytes(bytes(raw))
    with pytest.raises(PersistenceError, match="does not read back as it was published"):
        opened(tmp_path)
    tensor.unlink()
    with pytest.raises(PersistenceError, match=r"cannot read|corrupt"):
        opened(tmp_path)
