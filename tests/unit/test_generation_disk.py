"""Generations in a data directory without a network (store/generation_disk.py): what a crash
leaves half-written is deleted at start, generations retired before a crash are trimmed at start,
damaged files are set aside at start (never a silent loss or a wrong read, never a server that
cannot start), and a publish given up during its write leaves nothing, even where the write had
renamed it into place already."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorwire.errors import GenerationRetired, KeyNotFound, PersistenceError
from tensorwire.store import TensorStore, generation_disk
from tensorwire.store.generation_disk import QUARANTINE, ROOT, Ticket, number_dir, prefix_dir
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


def test_a_damaged_generation_is_set_aside_at_start(tmp_path: Path) -> None:
    gens = opened(tmp_path)
    publish(gens, "p", 1)
    publish(gens, "p", 2)
    home = tmp_path / ROOT / prefix_dir("p")
    tensor = next(p for p in (home / number_dir(2)).iterdir() if p.suffix == ".safetensors")
    raw = bytearray(tensor.read_bytes())
    raw[-1] ^= 0xFF  # one bit of its bytes
    tensor.write_bytes(bytes(raw))
    back = opened(tmp_path)
    assert back.quarantined == 1 and back.find("p", wg.LATEST).generation.number == 1
    (next(p for p in (home / number_dir(1)).iterdir() if p.suffix == ".safetensors")).unlink()
    again = opened(tmp_path)
    assert again.quarantined == 1 and len(again) == 0
    with pytest.raises(KeyNotFound):
        again.find("p", wg.LATEST)
    assert sorted(p.name[17:37] for p in (tmp_path / QUARANTINE).iterdir()) == [number_dir(1), number_dir(2)]


def test_a_generation_that_cannot_be_set_aside_names_its_directory(tmp_path: Path) -> None:
    gens = opened(tmp_path)
    publish(gens, "p", 1)
    directory = tmp_path / ROOT / prefix_dir("p") / number_dir(1)
    (directory / "generation.json").write_bytes(b"{")
    (tmp_path / QUARANTINE).write_bytes(b"not a folder")
    with pytest.raises(PersistenceError, match=f"{directory}.*move or remove it by hand"):
        opened(tmp_path)


def test_a_write_given_up_before_its_rename_leaves_nothing(tmp_path: Path) -> None:
    gens = opened(tmp_path)
    publish(gens, "p", 1)
    assert gens.disk is not None
    kept = gens.find("p", 1)
    ticket = Ticket()
    assert ticket.abandon() is False  # nothing in place yet
    second = dataclasses.replace(kept.generation, number=2)  # generation 1's tensors, as number 2
    with pytest.raises(PersistenceError, match="given up"):
        gens.disk.write(second, [kept.tensors[n] for n in kept.generation.names], ticket)
    home = tmp_path / ROOT / prefix_dir("p")
    assert [p.name for p in home.iterdir()] == [number_dir(1)]


def test_a_publish_given_up_after_its_rename_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk thread renamed the generation into place, and the publish is cancelled before the
    loop heard of it: the cancelled publish removes it at once (its client is told it failed)."""
    gens = opened(tmp_path)
    renamed, go_on = threading.Event(), threading.Event()
    write = generation_disk.GenerationDisk.write

    def write_then_hang(self: generation_disk.GenerationDisk, *args: Any) -> None:
        write(self, *args)
        renamed.set()
        go_on.wait(30)

    monkeypatch.setattr(generation_disk.GenerationDisk, "write", write_then_hang)
    meta = TensorMeta("p/w", torch.float32, (4,), 16)

    async def main() -> None:
        res = gens.store.reserve([meta])
        sums = [wg.chunk_checksums(res.buffers[0])]
        task = asyncio.ensure_future(gens.publish_durable("p", res, sums))
        await asyncio.to_thread(renamed.wait, 30)
        assert (tmp_path / ROOT / prefix_dir("p") / number_dir(1)).is_dir()  # in place already
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        go_on.set()

    asyncio.run(main())
    assert not (tmp_path / ROOT / prefix_dir("p") / number_dir(1)).exists()
    monkeypatch.undo()
    with pytest.raises(KeyNotFound):
        opened(tmp_path).find("p", wg.LATEST)
