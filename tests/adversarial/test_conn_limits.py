"""Refused and handshaking connections are bounded with the admitted ones (issue 32, class 12).

``--max-connections`` bounded the sessions, but a connection over it was answered (LimitExceeded)
within ``--auth-timeout``, and over TLS that answer waits for the peer's handshake: each refused
silent socket held a descriptor meanwhile, and the listener accepted without bound. 300 silent TLS
sockets against a cap of 16 held ~300 descriptors, and a connected client's persisted put then
failed with EMFILE (here the server runs with 128 descriptors at most, so the flood exhausts them).

Now at most ``Server.refusals`` (16) over-limit connections are answered at once; the rest are
closed unanswered as they are accepted, each counted in ``tensorwire_connections_refused_total``
(reason ``limit``) and logged (``answered=false``). A gRPC listener's cap (grpcio's own quota)
already closes at once; its descriptors are checked too.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

import tensorwire
from tensorwire._aio import run
from tensorwire.cli.status import ask_status
from tensorwire.client import ClientOptions
from tensorwire.security import TlsFiles, write_dev_certs
from tensorwire.server import metrics
from tensorwire.server.options import DEFAULT_REFUSALS
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.types import Address

CAP = 16
FLOOD = 300
SLACK = 6  # descriptors a server may open meanwhile for its own ends (a log write, a disk commit)
# The server runs with at most this many descriptors: the flood exhausts them unless it is bounded.
LIMITED = [sys.executable, "-c", "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
           "(128, 128)); os.execv(sys.argv[1], sys.argv[1:])"]  # fmt: skip


@contextlib.contextmanager
def flood(url: str, count: int = FLOOD) -> Iterator[list[socket.socket]]:
    """``count`` connections that never say a word (no TLS ClientHello, no frame)."""
    address = Address.parse(url)
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            socks.append(socket.create_connection((address.host, address.port), timeout=10))
        yield socks
    finally:
        for sock in socks:
            sock.close()


def peak_fds(pid: int, seconds: float) -> int:
    """The most descriptors the process held, sampled every 10 ms over ``seconds``."""
    process = psutil.Process(pid)
    peak, until = 0, time.monotonic() + seconds
    while time.monotonic() < until:
        peak = max(peak, process.num_fds())
        time.sleep(0.01)  # a sampling period, not a wait for something
    return peak


def refused_total(srv: ServerProcess, ca: Path) -> float:
    url = run(ask_status(srv.url, ClientOptions(timeout=10.0, tls=TlsFiles(ca=ca))))["metrics"]
    with urllib.request.urlopen(url, timeout=10) as answer:
        samples = metrics.parse(answer.read().decode())
    return sum(
        v for labels, v in samples["tensorwire_connections_refused_total"] if labels["reason"] == "limit"
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_dev_certs(tmp_path_factory.mktemp("certs"))


def test_silent_tls_sockets_hold_no_more_than_the_cap_and_the_refusals(
    certs: dict[str, Path], tmp_path: Path
) -> None:
    tls = ["--tls-cert", str(certs["server"]), "--tls-key", str(certs["server_key"]), "--metrics-port", "0"]
    extra = ["--max-connections", str(CAP), "--auth-timeout", "3", *tls]
    with ServerProcess("tls://127.0.0.1:0", data_dir=tmp_path / "data", extra=extra, wrapper=LIMITED) as srv:
        base = psutil.Process(srv.pid).num_fds()
        options = {"retries": 0, "timeout": 10.0, "tls": TlsFiles(ca=certs["ca"])}
        with tensorwire.connect(srv.url, **options) as client:  # admitted before the flood
            client.put("kept/before", torch.arange(8))
            with flood(srv.url):
                wait_for(lambda: srv.output().count("connection refused") >= 100, 10, "refusals")
                held = peak_fds(srv.pid, 0.5)
                # The client admitted before is served all along, its puts written to disk.
                client.put("kept/during", torch.arange(16))
                assert torch.equal(client.get("kept/during"), torch.arange(16))
                assert held <= base + CAP + DEFAULT_REFUSALS + SLACK, f"{held} descriptors held (from {base})"
                refusals = FLOOD - (CAP - 1)
                wait_for(lambda: srv.output().count("connection refused") >= refusals, 10, "every refusal")
        assert srv.output().count("answered=false") >= refusals - DEFAULT_REFUSALS
        assert refused_total(srv, certs["ca"]) >= refusals


def test_a_grpc_listener_caps_its_descriptors_too(tmp_path: Path) -> None:
    extra = ["--listen", "grpc://127.0.0.1:0", "--max-connections", str(CAP), "--auth-timeout", "3"]
    with ServerProcess(data_dir=tmp_path / "data", extra=extra, wrapper=LIMITED) as srv:
        base = psutil.Process(srv.pid).num_fds()
        with flood(srv.urls[1]):
            held = peak_fds(srv.pid, 1.0)
            assert held <= base + CAP + SLACK, f"{held} descriptors held (from {base})"
            with tensorwire.connect(srv.url, retries=0, timeout=10.0) as client:  # tcp:// beside it
                client.put("kept/grpc", torch.arange(4))
