"""Real processes, real signals: what survives a server or a client dying mid-transfer."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import tensorwire
from tensorwire import errors
from tensorwire.testing.process import ServerProcess, wait_for

BIG = 256 << 20


def test_server_killed_mid_put_fails_fast_and_a_restart_serves_again(tmp_path: Path) -> None:
    srv = ServerProcess(data_dir=tmp_path)
    port = srv.url.rsplit(":", 1)[1]
    try:
        with tensorwire.connect(srv.url, timeout=10, retries=0) as c:
            c.put("kept", torch.arange(10))
            killed = threading.Event()

            def kill_once(_: int) -> None:
                if not killed.is_set():
                    killed.set()
                    srv.signal(signal.SIGKILL)

            start = time.monotonic()
            with pytest.raises(errors.TransportError):
                c.put("victim", torch.ones(BIG // 4), progress=kill_once)
            assert killed.is_set() and time.monotonic() - start < 10
    finally:
        srv.stop()
    # Same port, same data directory: the acknowledged tensor is back, the torn one never existed.
    again = ServerProcess(listen=f"tcp://127.0.0.1:{port}", data_dir=tmp_path)
    with again, tensorwire.connect(again.url) as c:
        assert [m.name for m in c.list()] == ["kept"]
        assert torch.equal(c.get("kept"), torch.arange(10))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_client_reconnects_after_the_server_restarts() -> None:
    srv = ServerProcess()
    url = srv.url
    try:
        c = tensorwire.connect(url, timeout=5, retries=8, backoff=0.05, max_backoff=0.5)
        c.put("x", torch.ones(3))
        srv.stop()
        srv = ServerProcess(listen=url)  # back on the same port, empty
        assert c.put("x", torch.zeros(3)) >= 1  # the broken connection is replaced, not reported
        assert torch.equal(c.get("x"), torch.zeros(3))
        c.close()
    finally:
        srv.stop()


def test_a_stopped_server_times_out_with_a_clear_error_then_recovers() -> None:
    with ServerProcess() as srv, tensorwire.connect(srv.url, timeout=0.5, retries=0) as c:
        c.put("x", torch.ones(2))
        srv.signal(signal.SIGSTOP)
        start = time.monotonic()
        try:
            with pytest.raises(errors.TransferTimeout, match="get of 'x'"):
                c.get("x")
            assert time.monotonic() - start < 5
        finally:
            srv.signal(signal.SIGCONT)
        assert torch.equal(c.get("x"), torch.ones(2))  # a new connection, the same data


_CLIENT = textwrap.dedent(
    """
    import sys, torch, tensorwire
    c = tensorwire.connect(sys.argv[1])
    def said(_n, done=[]):
        if not done:
            done.append(1)
            print("sending", flush=True)
            sys.stdin.readline()  # wait here, mid-frame, until the test kills us
    c.put("half", torch.ones(%d // 4), progress=said)
    """
)


def test_client_killed_mid_put_leaves_nothing_and_frees_its_reservation() -> None:
    capacity = BIG + (BIG // 2)
    # The put is resumable (BIG is over the client's resumable_bytes): the server keeps its
    # verified bytes for a resume until its stall timeout, then frees them.
    with ServerProcess(capacity=str(capacity), extra=["--stall-timeout", "2"]) as srv:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CLIENT % BIG, srv.url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "sending"
            proc.kill()
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        with tensorwire.connect(srv.url, timeout=10) as c:
            assert c.list() == []

            def reservation_released() -> bool:
                try:
                    c.put("full", torch.zeros(BIG // 4))  # only fits once the dead put's bytes are free
                except errors.CapacityExceeded:
                    return False
                return True

            wait_for(reservation_released, 30, "the killed client's reservation to be released")
            assert c.stat("full").nbytes == BIG


def test_a_stalled_peer_does_not_block_other_clients() -> None:
    import socket

    with ServerProcess() as srv:
        host, port = srv.url.removeprefix("tcp://").rsplit(":", 1)
        stalled = socket.create_connection((host, int(port)), timeout=5)
        try:
            stalled.sendall(b"TWIR\x01")  # half a header, then nothing
            with tensorwire.connect(srv.url, timeout=5) as c:
                c.put("a", torch.ones(1000))
                assert torch.equal(c.get("a"), torch.ones(1000))
        finally:
            stalled.close()
