"""A local cluster: S parameter-server processes and W worker processes on this machine.

``tensorwire ps launch --servers 2 --workers 2 train.py ARGS`` starts the servers on free loopback
ports, then runs ``python train.py ARGS`` W times with the variables torchrun would set (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), ``TENSORWIRE_SERVERS`` and a fresh
``TENSORWIRE_JOB_TOKEN`` (the run's job belongs to its workers, ps/job.py; unless the launcher's
environment names one), which ``ps.Worker`` reads. When one worker fails the others are stopped
(in ``sync`` mode they would wait for it); whatever happens, every process started here is ended
before ``run`` returns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from tensorwire import topology
from tensorwire.logs import event
from tensorwire.ps.worker.rendezvous import SERVERS_ENV
from tensorwire.ps.worker.rpc import JOB_TOKEN_ENV
from tensorwire.security import write_token_file
from tensorwire.server.process import ServerProcess

log = logging.getLogger("tensorwire.ps.launch")
STOP_GRACE = 5.0  # seconds a process gets to exit after SIGTERM before SIGKILL


@contextlib.contextmanager
def local_servers(count: int, extra: Sequence[str] = (), replicas: int = 0) -> Iterator[list[str]]:
    """``count`` parameter servers on loopback, each a primary with ``replicas`` standby backups
    (the replicas of each slot share a fresh peer token, in a 0600 file removed after); yields each
    server's address (``primary|backup|...``, as ``ps.Worker`` takes them), stops all of them after.
    They keep their jobs when the workers leave (``--keep-jobs``): a local cluster serves one run,
    whose result its launcher reads (``pull_parameters``) before it stops the servers."""
    extra = ["--keep-jobs", *extra]
    if replicas:  # a weakened guarantee is never silent
        why = ("a local cluster runs on one host: a host failure loses a slot's primary and its "
               "backups; start servers on other hosts for that (docs/explanation/scaling.md)")  # fmt: skip
        event(log, logging.WARNING, "backups on the primary's host", servers=count, replicas=replicas,
              host=topology.here().host, why=why)  # fmt: skip
    servers: list[ServerProcess] = []
    peers = tempfile.TemporaryDirectory(prefix="tensorwire-peers-")  # 0700
    try:
        for number in range(count):
            if not replicas:
                servers.append(ServerProcess("tcp://127.0.0.1:0", capacity="16GiB", extra=extra))
                continue
            slot = [f"tcp://127.0.0.1:{free_port()}" for _ in range(replicas + 1)]
            token = write_token_file(Path(peers.name) / f"slot{number}.token")
            for index in reversed(range(len(slot))):  # the backups first: the primary sends to them
                flags = [*replica_flags(slot, index, token), *extra]
                servers.append(ServerProcess(slot[index], capacity="16GiB", extra=flags))
        yield _addresses(servers, replicas)
    finally:
        for server in servers:
            server.stop(STOP_GRACE)
        peers.cleanup()


def replica_flags(slot: Sequence[str], index: int, peer_token: Path) -> list[str]:
    """``tensorwire ps serve`` flags of replica ``index`` of a replica set: the first is the
    primary, the others standbys, and each names all the others as its backups (a standby that
    takes over replicates to the rest, its old primary included once it is back). ``peer_token``:
    the slot's peer-token file (``security.write_token_file``), the same for every replica of the slot."""
    return ["--peer-token-file", str(peer_token), *role_flags(slot, index)]


def role_flags(slot: Sequence[str], index: int) -> list[str]:
    """``replica_flags`` without the peer token (for a launcher that writes it on the replica's own
    node): ``--standby`` unless ``index`` is 0, and a ``--backup`` for each other replica."""
    flags = [] if index == 0 else ["--standby"]
    for other, url in enumerate(slot):
        if other != index:
            flags += ["--backup", url]
    return flags


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (an IPv4 or IPv6 address), for a server that must know its
    address before it starts (the replicas of a slot name each other)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _addresses(servers: Sequence[ServerProcess], replicas: int) -> list[str]:
    urls = [s.url for s in servers]
    size = replicas + 1
    return ["|".join(reversed(urls[i : i + size])) for i in range(0, len(urls), size)]


def start_workers(
    command: Sequence[str], workers: int, servers: Sequence[str], env: Mapping[str, str] | None = None
) -> list[subprocess.Popen[bytes]]:
    """Start ``command`` once per rank, with the rank variables, the servers and the job's token
    (one per call, unless ``env`` or this process's environment has one) in its environment."""
    procs: list[subprocess.Popen[bytes]] = []
    token = {JOB_TOKEN_ENV: secrets.token_hex(24)}  # the workers' job is theirs (ps/job.py)
    try:
        for rank in range(workers):
            child = {**token, **os.environ, **(env or {})}
            child.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(workers),
                         LOCAL_WORLD_SIZE=str(workers), **{SERVERS_ENV: ",".join(servers)})  # fmt: skip
            procs.append(subprocess.Popen(list(command), env=child))
    except BaseException:
        stop_all(procs)
        raise
    return procs


def wait_workers(procs: Sequence[subprocess.Popen[bytes]], timeout: float | None = None) -> int:
    """Wait for every worker; the first failure stops the rest. Returns 0, or the failing code
    (124 when ``timeout`` ran out)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None:  # killed by a signal: the shell's 128 + signal number
                return failed if failed > 0 else 128 - failed
            if all(c == 0 for c in codes):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                return 124
            with contextlib.suppress(subprocess.TimeoutExpired):
                next(p for p in procs if p.poll() is None).wait(0.1)
    finally:
        stop_all(procs)


def stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process still running, then SIGKILL those that outlive ``STOP_GRACE``."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_GRACE)


def run(
    script: Sequence[str], servers: int, workers: int, timeout: float | None = None, replicas: int = 0
) -> int:
    """``tensorwire ps launch``: the cluster, the workers, their exit code. A SIGTERM to the
    launcher ends the whole cluster too (it unwinds through the same cleanup as Ctrl-C)."""
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with local_servers(servers, replicas=replicas) as urls:
            procs = start_workers([sys.executable, *script], workers, urls)
            return wait_workers(procs, timeout)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
