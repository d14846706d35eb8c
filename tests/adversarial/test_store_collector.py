"""A peer that stores many small tensors makes the cyclic garbage collector's full passes walk what
it stored, and each pass stops the server's loop for every connection. The store keeps that to one
tracked object per tensor (it was four: the entry, its metadata tuple, a view of its bytes and the
view's buffer), so the pauses are about half as long (113-164 against 255-320 ms with 300,000
tensors stored: the process holds other objects too)."""

from __future__ import annotations

import gc

import torch

from tensorwire.store import TensorStore
from tensorwire.types import TensorMeta

COUNT = 20_000


def _store(store: TensorStore, first: int, count: int) -> None:
    for start in range(first, first + count, 1000):
        metas = [TensorMeta(f"m/{i}", torch.float32, (16,), 64) for i in range(start, start + 1000)]
        reservation = store.reserve(metas)
        for buffer in reservation.buffers:
            buffer[:] = bytes(64)
        store.commit(reservation)


def test_each_small_stored_tensor_is_one_object_for_the_collector() -> None:
    store = TensorStore(capacity=1 << 30, max_tensors=1_000_000)
    _store(store, 0, 10)  # the store's own first objects
    gc.collect()
    before = len(gc.get_objects())
    _store(store, 10, COUNT)
    gc.collect()
    per_tensor = (len(gc.get_objects()) - before) / COUNT
    assert per_tensor < 1.1, f"{per_tensor:.2f} tracked objects per stored tensor"


def test_a_stored_tensor_reads_back_as_written_and_as_a_view_each_time() -> None:
    """The bytes kept as their buffer still read as a writable byte view of exactly the tensor."""
    store = TensorStore(capacity=1 << 20)
    meta = TensorMeta("t", torch.uint8, (5,), 5)
    reservation = store.reserve([meta])
    reservation.buffers[0][:] = b"abcde"
    version = store.commit(reservation)
    [entry] = store.acquire(["t"])
    try:
        assert bytes(entry.data) == b"abcde" and entry.data.format == "B" and entry.data.nbytes == 5
        assert entry.meta == TensorMeta("t", torch.uint8, (5,), 5, version)
    finally:
        store.release([entry])
