"""A large put survives a broken connection or a corrupt chunk: it resumes from the last chunk
the server verified, not from byte 0; an upload nobody resumes is dropped and its bytes freed."""

from __future__ import annotations

import time

import torch

import tensorwire
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.store.uploads import Uploads
from tensorwire.testing.faults import FaultyProxy
from tensorwire.types import MiB, TensorMeta

SIZE = 96 * MiB


def put_with_a_fault(fault: str) -> tuple[int, int, list[int]]:
    """(bytes relayed to the server, faults made, where the put resumed) for one put."""
    tensor = torch.rand(SIZE // 4)
    with ServerThread() as server, FaultyProxy(server.url) as proxy:
        with tensorwire.connect(proxy.url, timeout=30, chunk_size=1 * MiB) as client:
            sent = 0

            def halfway(n: int) -> None:
                nonlocal sent
                sent += n
                if sent >= SIZE // 2 and not (proxy.dropped or proxy.corrupted or proxy._corrupt_next):
                    proxy.drop() if fault == "drop" else proxy.corrupt()

            client.put("big", tensor, progress=halfway)
            assert torch.equal(client.get("big"), tensor)
            resumed = client.resumed_at
        return proxy.bytes_up, proxy.dropped + proxy.corrupted, resumed


def test_a_put_resumes_after_its_connection_breaks() -> None:
    relayed, faults, resumed = put_with_a_fault("drop")
    assert faults == 1 and len(resumed) == 1 and resumed[0] >= SIZE // 8
    assert relayed < 1.6 * SIZE, f"{relayed / SIZE:.2f}x the tensor went up: it started again"


def test_a_put_resumes_after_a_corrupt_chunk() -> None:
    """The rest of the frame still crosses (the stream must stay in step); the resend starts at
    the bad chunk: less than twice the tensor in all."""
    relayed, faults, resumed = put_with_a_fault("corrupt")
    assert faults == 1 and len(resumed) == 1 and resumed[0] >= SIZE // 8
    assert relayed <= 2 * SIZE - resumed[0] + 8 * MiB


def test_an_upload_nobody_resumes_is_dropped_and_its_bytes_freed() -> None:
    store = TensorStore(capacity=64 * MiB)
    uploads = Uploads(store, limit=4, idle_timeout=10.0)
    meta = TensorMeta("w", torch.float32, (1024,), 4096)
    upload = uploads.claim(7, meta, 0)
    uploads.release(upload)
    assert store.used >= 4096 and uploads.resume_point(7, meta) == 0
    uploads.expire(time.monotonic() + 5)
    assert len(uploads) == 1  # not idle for long enough yet
    uploads.expire(time.monotonic() + 11)
    assert len(uploads) == 0 and store.used == 0
