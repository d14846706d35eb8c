"""A parameter server cut off by a network partition: the server runs in a network namespace of
its own (``ip netns`` + a veth pair, made and removed by the test) and the link is cut. Skipped,
with the reason, where the machine does not allow network namespaces."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import ps_job
import pytest
import torch

from tensorwire.errors import TensorwireError
from tensorwire.ps import ParamServer, Worker
from tensorwire.ps.worker.config import MARGIN
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.security import Security, load_token, write_token_file
from tensorwire.server import ServerThread
from tensorwire.testing.process import ServerProcess, wait_for


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def namespace(index: int) -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair: (name, host link, its address)."""
    tag = f"{os.getpid() % 10000}{index}"
    ns, host, inside = f"tw{tag}", f"twh{tag}", f"twn{tag}"
    subnet = f"10.{77 + index}.{os.getpid() % 200}"
    try:
        _ip("netns", "add", ns)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"network namespaces are not allowed here: {exc}")
    try:
        _ip("link", "add", host, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("addr", "add", f"{subnet}.1/24", "dev", host)
        _ip("link", "set", host, "up")
        _ip("netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/24", "dev", inside)
        _ip("netns", "exec", ns, "ip", "link", "set", inside, "up")
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, host, f"{subnet}.2"
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", host)
        _ip("netns", "del", ns)


def _reachable(url: str) -> bool:
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1.0):
        return True
    return False


def train(worker: Worker, model: torch.nn.Module, steps: range) -> None:
    for step in steps:
        x, y = ps_job.batch(0, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        worker.step()


def test_a_cut_off_server_fails_with_a_clear_error_within_the_timeout() -> None:
    with namespace(0) as (ns, host, address):
        server = ServerProcess(f"tcp://{address}:0", wrapper=["ip", "netns", "exec", ns])
        try:
            model = ps_job.model()
            timeout = 4.0
            with Worker(model, server.url, "async", rank=0, timeout=timeout, heartbeat=0.25) as worker:
                train(worker, model, range(3))
                _ip("link", "set", host, "down")  # the partition
                start = time.monotonic()
                with pytest.raises(TensorwireError) as failure:
                    train(worker, model, range(3, 4))
                waited = time.monotonic() - start
                # One request's bound: the worker's timeout plus MARGIN (a request outwaits the
                # server's own wait by MARGIN, so that the server's TIMEOUT, naming the workers it
                # waited for, comes first); the step fails within it, not after a retry's second wait.
                bound = timeout + MARGIN
                assert waited < bound + timeout, f"waited {waited:.1f}s, bound {bound:.0f}s"
                assert address in str(failure.value)
                _ip("link", "set", host, "up")  # healed: the same worker goes on
                # once the link carries packets again: on a busy machine the veth's carrier can take
                # longer to come back than the worker's rejoin deadline (which is not what is tested)
                wait_for(lambda: _reachable(server.url), 30, "the healed link")
                train(worker, model, range(4, 6))
        finally:
            server.stop()


def test_workers_fail_over_from_a_cut_off_primary(tmp_path: Path) -> None:
    peer = write_token_file(tmp_path / "peer.token")  # the slot's
    with namespace(1) as (ns, host, address):
        backup_ps = ParamServer(standby=True, failover_timeout=1.0, peer=Security(token=load_token(peer)))
        with ServerThread(["tcp://0.0.0.0:0"], extensions=[backup_ps]) as backup:
            backup_url = f"tcp://{address.rsplit('.', 1)[0]}.1:{backup.addresses[0].port}"
            flags = ["--backup", backup_url, "--peer-token-file", str(peer)]
            primary = ServerProcess(f"tcp://{address}:0", extra=flags, wrapper=["ip", "netns", "exec", ns])
            try:
                model = ps_job.model()
                slot = f"{primary.url}|{backup.url}"
                with Worker(model, slot, "async", rank=0, timeout=30, heartbeat=0.25) as worker:
                    train(worker, model, range(3))
                    _ip("link", "set", host, "down")  # the primary is cut off from everyone
                    start = time.monotonic()
                    train(worker, model, range(3, 5))
                    print(f"failover after a partition: {time.monotonic() - start:.2f}s")
                (stats,) = server_stats([backup.url])
                assert stats["role"] == "primary" and stats["version"] == 5
            finally:
                primary.stop()
