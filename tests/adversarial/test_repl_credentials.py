"""Issue 13, item 1: replication with credentials. A primary authenticates to its backups with the
slot's peer token (and peer TLS files), so that a server with a client token (or TLS) still has
its copies; a backup that refuses the primary's credentials is an error the worker, the log, the
metrics and `tensorwire status` show, never a silent acknowledgement with fewer copies."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tensorwire.cli.status import collect, summary
from tensorwire.errors import ServerError
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.security import Security, TlsFiles, load_token, write_dev_certs, write_token_file
from tensorwire.server import ServerThread
from tensorwire.server.options import MetricsOptions, ServerOptions
from tensorwire.testing.faults import kill9
from tensorwire.testing.process import ServerProcess

CLIENT = "the-clients-token"
PEER = "the-slot-peer-token"


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def steps(worker: Worker, net: torch.nn.Module, first: int, count: int) -> None:
    for step in range(first, first + count):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        F.cross_entropy(net(x), y).backward()  # type: ignore[no-untyped-call]
        worker.step()


def reference(count: int) -> dict[str, torch.Tensor]:
    """The model after ``count`` async steps on one unreplicated server, without faults."""
    net = model()
    with (
        ServerThread(extensions=[ParamServer()]) as server,
        Worker(net, server.url, "async", SGD(lr=0.1), rank=0, heartbeat=0) as worker,
    ):
        steps(worker, net, 0, count)
    return net.state_dict()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_with_a_token_a_killed_primary_s_backup_holds_every_acknowledged_push(tmp_path: Path) -> None:
    """Real processes, every one with --token-file: kill -9 the primary after pushes were
    acknowledged; the backup takes over with every one of them (bit-identical to no fault)."""
    expected = reference(6)
    client = write_token_file(tmp_path / "client.token")
    flags = ["--token-file", str(client), "--peer-token-file", str(write_token_file(tmp_path / "peer.token"))]
    token = load_token(client)
    with (
        ServerProcess(extra=[*flags, "--standby", "--failover-timeout", "0.5"]) as backup,
        ServerProcess(extra=[*flags, "--backup", backup.url]) as primary,
    ):
        net = model()
        slot = f"{primary.url}|{backup.url}"
        with Worker(net, slot, "async", SGD(lr=0.1), rank=0, token=token, heartbeat=0, timeout=30) as worker:
            steps(worker, net, 0, 4)  # acknowledged by the primary
            (before,) = server_stats([backup.url], token=token)
            kill9(primary.proc)()
            steps(worker, net, 4, 2)  # the worker moves to the backup, which takes over
        (after,) = server_stats([backup.url], token=token)
    assert before["role"] == "backup" and before["version"] == 4  # it had them before the kill
    assert after["role"] == "primary" and after["failovers"] == 1
    assert after["version"] == after["pushes_applied"] == 6 and after["workers"]["0"]["seq"] == 6
    assert same(net.state_dict(), expected)


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, Path]:
    return write_dev_certs(tmp_path / "certs")


@pytest.mark.parametrize("trusts_the_ca", [True, False])
def test_a_tls_backup_gets_the_changes_over_tls_with_the_peer_tls_files(
    certs: dict[str, Path], trusts_the_ca: bool
) -> None:
    """The backup serves tls:// to its peers (tcp:// to workers here): with --peer-tls-ca the
    primary replicates over TLS and the backup takes over with every push; without it the
    backup's certificate does not verify, a configuration error: the worker is refused."""
    files = TlsFiles(certs["server"], certs["server_key"])
    backup_ps = ParamServer(standby=True, failover_timeout=0.3, peer=Security(token=PEER))
    served = ServerOptions(tls=files, token=CLIENT)
    with ServerThread(
        ["tcp://127.0.0.1:0", "tls://127.0.0.1:0"],
        served,
        extensions=[backup_ps],
    ) as backup:
        tcp_url, tls_url = (str(a) for a in backup.addresses)
        peer = Security(TlsFiles(ca=certs["ca"]) if trusts_the_ca else None, PEER)
        primary_ps = ParamServer(backups=[tls_url], peer=peer)
        with ServerThread(options=ServerOptions(token=CLIENT), extensions=[primary_ps]) as primary:
            net = model()
            worker = Worker(net, f"{primary.url}|{tcp_url}", "async", SGD(lr=0.1), rank=0, token=CLIENT,
                            heartbeat=0, timeout=20)  # fmt: skip
            if not trusts_the_ca:
                with pytest.raises(ServerError, match=rf"backup {tls_url} refuses.*does not verify"):
                    worker.start()
                assert primary_ps.config is None  # nothing was acknowledged
                assert primary_ps.status()["ps"]["backups"][tls_url]["refused"]
                return
            with worker:
                steps(worker, net, 0, 3)
                primary.close()
                steps(worker, net, 3, 1)
    assert backup_ps.role == "primary" and backup_ps.version == 4


@pytest.fixture
def refusing_slot(request: pytest.FixtureRequest) -> Iterator[tuple[ParamServer, ServerThread, str]]:
    """A primary whose backup was given another peer token (a misconfigured slot)."""
    client = request.param
    backup_ps = ParamServer(standby=True, peer=Security(token="another-peer-token"))
    with ServerThread(options=ServerOptions(token=client), extensions=[backup_ps]) as backup:
        primary_ps = ParamServer(backups=[backup.url], peer=Security(token=PEER))
        with ServerThread(
            options=ServerOptions(token=client, metrics=MetricsOptions(port=0)), extensions=[primary_ps]
        ) as primary:
            yield primary_ps, primary, backup.url


@pytest.mark.parametrize("refusing_slot", [CLIENT, None], indirect=True, ids=["client-token", "no-token"])
def test_a_backup_refusing_the_primary_s_credentials_refuses_changes_visibly(
    refusing_slot: tuple[ParamServer, ServerThread, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Refused at HELLO (the backup has a client token) or at PS_REPLICATE (it has none): the
    worker's change is refused with an error naming the backup; log, metric and status say so."""
    primary_ps, primary, backup_url = refusing_slot
    caplog.set_level(logging.WARNING)
    token = primary.server.security.token
    worker = Worker(model(), primary.url, "async", rank=0, token=token, heartbeat=0, timeout=20)
    with pytest.raises(ServerError, match=rf"backup {backup_url} refuses this primary's peer credentials"):
        worker.start()
    assert primary_ps.config is None and primary_ps.version == 0  # not made, not acknowledged
    assert any("refuses this primary's peer credentials" in r.getMessage() for r in caplog.records)
    registry = primary.server.registry
    assert registry.get_sample_value("tensorwire_ps_backup_refused", {"backup": backup_url}) == 1
    assert registry.get_sample_value("tensorwire_ps_backup_up", {"backup": backup_url}) == 0
    assert registry.get_sample_value("tensorwire_ps_replication_refusals_total") >= 1
    (node,) = collect([primary.url], timeout=5, token=token)
    assert node.status is not None and node.status["ps"]["backups"][backup_url]["refused"]
    assert "REFUSED" in summary(node)["lag"]


def test_a_backup_that_is_down_is_shown_lost_while_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """A backup that is merely down: today's trade (fewer copies), but visibly."""
    from tensorwire.ps.launch import free_port

    caplog.set_level(logging.WARNING)
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    primary_ps = ParamServer(backups=[nowhere], peer=Security(token=PEER))
    with ServerThread(extensions=[primary_ps]) as primary:
        net = model()
        with Worker(net, primary.url, "async", SGD(lr=0.1), rank=0, heartbeat=0, timeout=20) as worker:
            steps(worker, net, 0, 2)
        assert primary_ps.version == 2
        assert primary.server.registry.get_sample_value("tensorwire_ps_backup_up", {"backup": nowhere}) == 0
        (node,) = collect([primary.url], timeout=5)
    assert "LOST" in summary(node)["lag"]
    assert any("backup lost" in r.getMessage() for r in caplog.records)


def test_a_silent_backup_host_does_not_stall_every_change(caplog: pytest.LogCaptureFixture) -> None:
    """A backup host that accepts connections and never answers (a hung host): once it is lost,
    retrying it (each ping) happens in the background, not inside the order of changes, where each
    try held every push for the connect timeout (5 s)."""
    caplog.set_level(logging.WARNING)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel completes handshakes; nobody ever answers HELLO
        url = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        primary_ps = ParamServer(backups=[url], peer=Security(token=PEER))
        with ServerThread(extensions=[primary_ps]) as primary:
            net = model()
            with Worker(net, primary.url, "async", SGD(lr=0.1), rank=0, heartbeat=0, timeout=30) as worker:
                assert primary_ps.status()["ps"]["backups"][url]["up"] is False  # given up on at the start
                slowest, started, step = 0.0, time.monotonic(), 0
                while time.monotonic() - started < 2:  # spans several pings (every 0.5 s)
                    before = time.monotonic()
                    steps(worker, net, step, 1)
                    slowest, step = max(slowest, time.monotonic() - before), step + 1
    assert slowest < 2.5, f"a push waited {slowest:.1f}s behind a retry of the silent backup"
    assert any("backup lost" in r.getMessage() for r in caplog.records)
