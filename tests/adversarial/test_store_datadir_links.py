"""Sweep (files in the data directory never follow symlinks): a symbolic link planted in a data
directory is refused, never read or written through."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tensorwire.errors import PersistenceError
from tensorwire.store import TensorStore
from tensorwire.store.revision import SLOTS_FILE
from tensorwire.store.tensor_file import file_name
from tensorwire.types import MiB, TensorMeta


def put(store: TensorStore, name: str, data: bytes) -> int:
    res = store.reserve([TensorMeta(name, torch.uint8, (len(data),), len(data))])
    res.buffers[0][:] = data
    return store.commit(res)


def test_a_tensor_file_that_is_a_link_is_refused_at_start(tmp_path: Path) -> None:
    elsewhere = TensorStore(1 * MiB, tmp_path / "elsewhere")  # a valid file, outside the directory
    put(elsewhere, "secret", b"not yours")
    data = tmp_path / "data"
    put(TensorStore(1 * MiB, data), "mine", b"ok")
    os.symlink(tmp_path / "elsewhere" / file_name("secret"), data / file_name("secret"))
    with pytest.raises(PersistenceError, match="symbolic link"):
        TensorStore(1 * MiB, data)


def test_the_revision_record_is_never_written_through_a_link(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = TensorStore(1 * MiB, data)
    put(store, "a", b"1")
    target = tmp_path / "target"
    target.write_bytes(bytes(4096))
    (data / SLOTS_FILE).unlink()
    os.symlink(target, data / SLOTS_FILE)
    with pytest.raises(PersistenceError):
        store.delete(["a"])
    assert target.read_bytes() == bytes(4096)
