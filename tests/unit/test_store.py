"""TensorStore: capacity, versions, atomic batches, buffer reuse, and persistence across restarts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tensorwire.errors import CapacityExceeded, InvalidName, InvalidTensor, KeyNotFound
from tensorwire.store import TensorStore
from tensorwire.store.memory import entry_cost
from tensorwire.types import MiB, TensorMeta


def meta(name: str, n: int) -> TensorMeta:
    return TensorMeta(name, torch.uint8, (n,), n)


def put(store: TensorStore, items: dict[str, bytes]) -> int:
    res = store.reserve([meta(k, len(v)) for k, v in items.items()])
    for buf, data in zip(res.buffers, items.values(), strict=True):
        buf[:] = data
    return store.commit(res)


def test_versions_increase_and_batches_share_one() -> None:
    store = TensorStore(capacity=1 * MiB)
    v1 = put(store, {"a": b"1"})
    v2 = put(store, {"a": b"2", "b": b"3"})
    assert v2 > v1 and {m.version for m in store.list()} == {v2}
    store.delete(["a"])
    v3 = put(store, {"a": b"4"})
    assert v3 > v2  # never reused after a delete


def test_nothing_is_visible_before_commit_and_abort_leaves_no_trace() -> None:
    store = TensorStore(capacity=1 * MiB)
    res = store.reserve([meta("x", 10)])
    assert store.list() == [] and store.used == 10 + entry_cost("x")
    store.abort(res)
    assert store.list() == [] and store.used == 0
    with pytest.raises(KeyNotFound):
        store.stat(["x"])


def test_capacity_counts_reservations_and_frees_on_delete() -> None:
    names = entry_cost("a")  # every one-letter name costs the same
    store = TensorStore(capacity=100 + 2 * names)
    put(store, {"a": bytes(60)})
    with pytest.raises(CapacityExceeded):
        store.reserve([meta("b", 50)])
    res = store.reserve([meta("b", 40)])
    with pytest.raises(CapacityExceeded):  # the open reservation counts
        store.reserve([meta("c", 1)])
    store.abort(res)
    store.delete(["a"])
    put(store, {"b": bytes(100)})
    assert store.used == 100 + names


def test_refused_batches_change_nothing() -> None:
    store = TensorStore(capacity=1 * MiB)
    with pytest.raises(InvalidName):
        store.reserve([meta("ok", 1), meta("../bad", 1)])
    with pytest.raises(InvalidName):
        store.reserve([meta("dup", 1), meta("dup", 1)])
    with pytest.raises(InvalidTensor):
        store.reserve([TensorMeta("lie", torch.float32, (2,), 7)])
    put(store, {"keep": b"k"})
    with pytest.raises(KeyNotFound):  # deletes are all or nothing
        store.delete(["keep", "missing"])
    assert [m.name for m in store.list()] == ["keep"] and store.used == 1 + entry_cost("keep")


def test_large_buffers_are_reused_but_never_while_pinned() -> None:
    store = TensorStore(capacity=64 * MiB)
    put(store, {"w": bytes(2 * MiB)})
    (first,) = store.acquire(["w"])
    put(store, {"w": b"\x01" * (2 * MiB)})  # replaces a pinned entry: its buffer must not be reused
    res = store.reserve([meta("other", 2 * MiB)])
    assert not _same_memory(res.buffers[0], first.data)
    store.abort(res)
    assert bytes(first.data[:4]) == bytes(4)  # the reader still sees the old bytes
    store.release([first])
    res = store.reserve([meta("w2", 2 * MiB)])
    assert _same_memory(res.buffers[0], first.data)  # once released, reused instead of fresh pages
    store.abort(res)


def _same_memory(a: memoryview, b: memoryview) -> bool:
    return bool(np.frombuffer(a, np.uint8).ctypes.data == np.frombuffer(b, np.uint8).ctypes.data)


def test_persistence_survives_a_restart(tmp_path: Path) -> None:
    store = TensorStore(capacity=1 * MiB, data_dir=tmp_path)
    put(store, {"m/a": b"abc", "m/b": b"xyz"})
    v = put(store, {"m/a": b"new"})
    store.delete(["m/b"])
    again = TensorStore(capacity=1 * MiB, data_dir=tmp_path)
    assert [(m.name, m.version) for m in again.list()] == [("m/a", v)]
    (entry,) = again.acquire(["m/a"])
    assert bytes(entry.data) == b"new"
    assert put(again, {"m/c": b"1"}) > v  # versions continue after a restart


def test_a_data_dir_larger_than_capacity_is_refused(tmp_path: Path) -> None:
    put(TensorStore(capacity=1 * MiB, data_dir=tmp_path), {"big": bytes(1000)})
    with pytest.raises(CapacityExceeded):
        TensorStore(capacity=10, data_dir=tmp_path)


def test_versions_of_deleted_tensors_are_not_reused_after_a_restart(tmp_path: Path) -> None:
    store = TensorStore(capacity=1 * MiB, data_dir=tmp_path)
    put(store, {"a": b"1"})
    newest = put(store, {"b": b"2"})
    store.delete(["b"])  # the newest version now lives in no file
    again = TensorStore(capacity=1 * MiB, data_dir=tmp_path)
    assert put(again, {"c": b"3"}) > newest


def test_abort_during_a_slow_persisted_commit_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server cancelled while a worker thread writes the data directory calls abort: it must
    not hand the buffers to the pool under the commit that is about to publish them."""
    import threading

    from tensorwire.store.persist import DataDir

    store = TensorStore(capacity=64 * MiB, data_dir=tmp_path)
    writing, release = threading.Event(), threading.Event()
    real_write = DataDir.write

    def slow_write(self: DataDir, items: object) -> None:
        writing.set()
        assert release.wait(10)
        real_write(self, items)  # type: ignore[arg-type]

    monkeypatch.setattr(DataDir, "write", slow_write)
    res = store.reserve([meta("w", 2 * MiB)])
    res.buffers[0][:] = b"\x07" * (2 * MiB)
    versions: list[int] = []
    worker = threading.Thread(target=lambda: versions.append(store.commit(res)))
    worker.start()
    assert writing.wait(10)
    store.abort(res)  # what a cancelled request does
    release.set()
    worker.join(10)
    assert versions and store.used == 2 * MiB + entry_cost("w")
    other = store.reserve([meta("other", 2 * MiB)])  # must not get the live tensor's buffer
    other.buffers[0][:4] = b"\x63" * 4
    (entry,) = store.acquire(["w"])
    assert bytes(entry.data[:4]) == b"\x07" * 4
