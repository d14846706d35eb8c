"""A connection cut in the middle of a GET's answer fails that GET at once with ConnectionLost,
not after the request's timeout: the answer's request was taken out of the pending table when its
header arrived, so the connection's failure must still reach it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tensorwire
from tensorwire.errors import ConnectionLost
from tensorwire.server import ServerThread
from tensorwire.testing.faults import FaultyProxy


def test_a_get_cut_midway_fails_at_once() -> None:
    big = torch.randn(16 << 20)  # 64 MiB: many chunks, so the cut lands inside the data
    with ServerThread() as srv, FaultyProxy(srv.url) as proxy:
        with tensorwire.connect(srv.url) as client:
            client.put("big", big)
        cut = threading.Event()

        def progress(done: int) -> None:
            if done and not cut.is_set():
                cut.set()
                threading.Thread(target=proxy.drop, daemon=True).start()

        with tensorwire.connect(proxy.url, retries=0, timeout=30) as client:
            started = time.monotonic()
            with pytest.raises(ConnectionLost):
                client.get("big", progress=progress)
            assert cut.is_set() and time.monotonic() - started < 10  # not the 30 s timeout
