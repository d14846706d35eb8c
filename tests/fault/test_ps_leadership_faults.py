"""Replica slots whose primary a real etcd decides (``ps serve --coordinator``), with real processes
killed and stopped with real signals: the lease holder killed, the lease holder paused past its
term and resumed (it must acknowledge nothing after it wakes), etcd itself killed and restarted.
Each run ends with the bits of the same run without faults: no acknowledged push lost, none
applied twice.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import ps_job
import pytest
import torch

from tensorwire.coordinator.local import LocalEtcd
from tensorwire.errors import TensorwireError
from tensorwire.ps import Worker
from tensorwire.ps.launch import free_port, replica_flags
from tensorwire.security import write_token_file
from tensorwire.testing.faults import kill9, sigcont, sigstop
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.testing.process import ps_role as role
from tensorwire.testing.process import ps_stats as stats

pytest.importorskip("aetcd", reason="the etcd extra (aetcd) is not installed")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd not on PATH (apt-get install etcd-server)"),
]

TTL = 2.0
WITHIN = 30.0


@pytest.fixture
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


def slot(etcd: LocalEtcd, tmp_path: Path, name: str, stack: ExitStack, ttl: float = TTL) -> list[str]:
    """Two replicas of slot ``name``, the first campaigning first; their URLs."""
    peer = write_token_file(tmp_path / f"{name}.peer")
    urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    lease = ["--coordinator", etcd.url, "--slot", name, "--lease-ttl", str(ttl)]
    for i, url in enumerate(urls):
        stack.enter_context(ServerProcess(url, extra=[*replica_flags(urls, i, peer), *lease]))
    wait_for(lambda: role(urls[0]) == "primary", WITHIN, "the first replica to take the lease")
    return urls


def steps(worker: Worker, model: torch.nn.Module, first: int, count: int) -> None:
    for step in range(first, first + count):
        x, y = ps_job.batch(0, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        worker.step()


def reference(count: int) -> dict[str, torch.Tensor]:
    from tensorwire.ps import ParamServer
    from tensorwire.server import ServerThread

    net = ps_job.model()
    with ServerThread(extensions=[ParamServer()]) as plain, Worker(net, plain.url, "async", rank=0) as worker:
        steps(worker, net, 0, count)
    return net.state_dict()


def same(model: torch.nn.Module, count: int) -> bool:
    expected = reference(count)
    return all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


def in_sync(url: str, member: str) -> bool:
    return member in (stats(url).get("coordinator") or {}).get("in_sync", [])


def test_a_killed_lease_holder_is_replaced_within_its_ttl(etcd: LocalEtcd, tmp_path: Path) -> None:
    with ExitStack() as stack:
        # A ttl the revocation beats by seconds even under load (it comes ~1.2 s after the kill;
        # the lease, left alone, would run 7-10 s).
        urls = slot(etcd, tmp_path, "killed", stack, ttl=5 * TTL)
        epoch = stats(urls[0])["epoch"]
        model = ps_job.model()
        with Worker(model, "|".join(urls), "async", rank=0, heartbeat=0.25, timeout=60) as worker:
            steps(worker, model, 0, 3)
            wait_for(lambda: in_sync(urls[0], urls[1]), WITHIN, "the backup in the in-sync set")
            kill9(stack_proc(stack, urls[0]))()
            wait_for(lambda: role(urls[1]) == "primary", WITHIN, "the backup to take the lease")
            steps(worker, model, 3, 3)
        assert stats(urls[1])["epoch"] > epoch
        # Its process is gone (its port refuses connections): the backup revoked its lease rather
        # than wait for it to run out (said by the backup, not by the time it took).
        backup = stack_server(stack, urls[1])
        assert stats(urls[1])["coordinator"]["revoked"] == 1, backup.output()[-4000:]
    assert same(model, 6)


def test_a_lease_holder_paused_past_its_term_acknowledges_nothing_after_it_wakes(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    with ExitStack() as stack:
        urls = slot(etcd, tmp_path, "paused", stack)
        first = stack_proc(stack, urls[0])
        model = ps_job.model()
        # The worker watches the slot's leader in etcd: it moves when the lease passes (without
        # heartbeats, a stopped process's connection neither answers nor breaks).
        with Worker(model, "|".join(urls), "async", rank=0, heartbeat=0, timeout=60,
                    coordinator=etcd.url) as worker:  # fmt: skip
            steps(worker, model, 0, 3)
            wait_for(lambda: in_sync(urls[0], urls[1]), WITHIN, "the backup in the in-sync set")
            sigstop(first)()
            try:
                stopped = time.monotonic()
                steps(worker, model, 3, 3)
                moved = time.monotonic() - stopped
                assert role(urls[1]) == "primary"
            finally:
                sigcont(first)()
            assert moved < TTL + 10, f"the worker moved {moved:.1f}s after the primary stopped"
            # Awake, the old primary serves nothing: its term ran out while it slept.
            wait_for(lambda: role(urls[0]) == "backup", WITHIN, "the old primary to step down and follow")
            assert stats(urls[0])["coordinator"]["step_downs"] >= 1
            # A worker that reaches only the old primary is refused (NOT_PRIMARY until its timeout).
            with pytest.raises(TensorwireError), Worker(ps_job.model(), urls[0], "sync", timeout=3) as stray:
                pytest.fail(f"the old primary admitted a worker at clock {stray.clock}")
    assert same(model, 6)


def test_with_etcd_down_a_primary_that_reaches_its_backup_keeps_serving(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    """The failsafe: no replica can take the lease while etcd is down, and the backup still
    applies every change, so the primary goes on; once etcd is back, a kill fails over again."""
    with ExitStack() as stack:
        urls = slot(etcd, tmp_path, "failsafe", stack)
        model = ps_job.model()
        with Worker(model, "|".join(urls), "async", rank=0, heartbeat=0.25, timeout=60) as worker:
            steps(worker, model, 0, 2)
            wait_for(lambda: in_sync(urls[0], urls[1]), WITHIN, "the backup in the in-sync set")
            etcd.kill()
            time.sleep(0)  # nothing to wait for: the next steps outlast the term
            steps(worker, model, 2, 4)  # more than a ttl of steps with etcd down
            wait_for(lambda: stats(urls[0])["coordinator"]["failsafe"], WITHIN, "the failsafe to be said")
            assert role(urls[0]) == "primary"
            etcd.start()
            wait_for(lambda: not stats(urls[0])["coordinator"]["failsafe"], WITHIN, "a term again")
            kill9(stack_proc(stack, urls[0]))()
            wait_for(lambda: role(urls[1]) == "primary", WITHIN, "the backup to take the lease")
            steps(worker, model, 6, 2)
    assert same(model, 8)


def stack_server(stack: ExitStack, url: str) -> ServerProcess:
    """The server listening at ``url`` among those ``stack`` started."""
    for callback in stack._exit_callbacks:  # type: ignore[attr-defined]
        server = getattr(callback[1], "__self__", None)
        if isinstance(server, ServerProcess) and server.url == url:
            return server
    raise LookupError(url)


def stack_proc(stack: ExitStack, url: str) -> Any:
    """The process of the server listening at ``url`` among those ``stack`` started."""
    return stack_server(stack, url).proc


LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")  # Debian's libfaketime


@pytest.mark.skipif(
    not LIBFAKETIME.exists(), reason="libfaketime missing (as root: apt-get install libfaketime)"
)
def test_a_clock_jump_on_the_primary_costs_its_term_not_an_acknowledgement(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    """The primary's clocks (wall and monotonic: a VM resumed, a clock stepped) jump 30 s ahead
    under libfaketime: by its own clock its term ran out, so it steps down rather than trust a
    lease it cannot vouch for; the slot goes on (a replica takes the lease again) and no push is
    lost or applied twice."""
    jump = tmp_path / "faketime"
    jump.write_text("+0\n")
    wrapper = ["env", f"LD_PRELOAD={LIBFAKETIME}", f"FAKETIME_TIMESTAMP_FILE={jump}", "FAKETIME_NO_CACHE=1"]
    peer = write_token_file(tmp_path / "peer")
    urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    lease = ["--coordinator", etcd.url, "--slot", "jump", "--lease-ttl", str(TTL)]
    with ExitStack() as stack:
        for i, url in enumerate(urls):
            flags = [*replica_flags(urls, i, peer), *lease]
            stack.enter_context(ServerProcess(url, extra=flags, wrapper=wrapper if i == 0 else ()))
        wait_for(lambda: role(urls[0]) == "primary", WITHIN, "the first replica to take the lease")
        model = ps_job.model()
        with Worker(model, "|".join(urls), "async", rank=0, heartbeat=0.25, timeout=60,
                    coordinator=etcd.url) as worker:  # fmt: skip
            steps(worker, model, 0, 3)
            wait_for(lambda: in_sync(urls[0], urls[1]), WITHIN, "the backup in the in-sync set")
            jump.write_text("+30\n")
            wait_for(
                lambda: stats(urls[0])["coordinator"]["step_downs"] >= 1, WITHIN, "the primary to step down"
            )
            steps(worker, model, 3, 3)
    assert same(model, 6)
