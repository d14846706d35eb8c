"""Metrics, STATUS and ``tensorwire status`` against live server processes.

* a server started with ``--metrics-port 0`` reports its metrics URL in STATUS; a real HTTP GET of
  it shows the counters moving with puts and gets (requests, bytes each way, store gauges)
* a parameter server's families move with training steps (steps, pushes, staleness, live workers)
* ``tensorwire status`` shows a primary, its backup (role, epoch, lag) and a server that is down,
  within its timeout, and exits 1
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import tensorwire
from tensorwire.cli import main
from tensorwire.cli.status import collect
from tensorwire.ps import SGD, Worker
from tensorwire.security import write_token_file
from tensorwire.server import metrics
from tensorwire.testing.process import ServerProcess

METRICS = ["--metrics-port", "0"]


def scrape(url: str) -> metrics.Samples:
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
        return metrics.parse(answer.read().decode())


def value(samples: metrics.Samples, name: str, **labels: str) -> float:
    found = [v for have, v in samples.get(name, []) if labels.items() <= have.items()]
    assert found, f"no sample {name}{labels}; have {sorted(samples)[:50]}"
    return sum(found)


def metrics_url(server_url: str) -> str:
    (node,) = collect([server_url], timeout=10)
    assert node.status is not None, node.error
    url = node.status["metrics"]
    assert isinstance(url, str) and url.startswith("http://127.0.0.1:")
    return url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_counters_move_with_puts_and_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORWIRE_LOG_FORMAT", "json")  # the server process inherits them
    monkeypatch.setenv("TENSORWIRE_LOG_LEVEL", "info")
    with ServerProcess(capacity="64MiB", extra=[*METRICS, "--grpc-listen", "127.0.0.1:0"]) as server:
        url = metrics_url(server.url)
        before = scrape(url)
        assert value(before, "tensorwire_store_capacity_bytes") == 64 << 20
        tensor = torch.arange(250_000, dtype=torch.float32)  # 1,000,000 bytes
        with tensorwire.connect(server.url, retries=0) as client:
            client.put("m/a", tensor)
            client.put("m/a", tensor)
            assert torch.equal(client.get("m/a"), tensor)
            with pytest.raises(KeyError):
                client.get("no/such")
        grpc_url = next(u for u in server.urls if u.startswith("grpc://"))
        with tensorwire.connect(grpc_url) as client:
            client.put("g/a", torch.ones(1000))
            assert torch.equal(client.get("g/a"), torch.ones(1000))
        after = scrape(url)
        events = [json.loads(line) for line in server.output().splitlines() if line.startswith("{")]
    assert any(e["event"] == "server started" and e["metrics"] == url for e in events), events
    assert value(after, "tensorwire_requests_total", op="put", transport="tcp") == 2
    assert value(after, "tensorwire_requests_total", op="get", transport="tcp") == 2
    assert value(after, "tensorwire_received_bytes_total", op="put", transport="tcp") == 2_000_000
    assert value(after, "tensorwire_sent_bytes_total", op="get", transport="tcp") == 1_000_000
    assert value(after, "tensorwire_request_errors_total", op="put", transport="tcp") == 0
    assert value(after, "tensorwire_request_errors_total", op="get", transport="tcp") == 1
    assert value(after, "tensorwire_requests_total", op="put", transport="grpc") == 1
    assert value(after, "tensorwire_received_bytes_total", op="put", transport="grpc") >= 4000
    assert value(after, "tensorwire_sent_bytes_total", op="get", transport="grpc") >= 4000
    assert value(after, "tensorwire_store_bytes") == 1_004_000
    assert value(after, "tensorwire_store_tensors") == 2
    assert value(after, "tensorwire_requests_in_flight") == 0
    assert value(after, "process_cpu_seconds_total") > 0  # the process collector is in the registry
    assert value(after, "process_resident_memory_bytes") > 0


def test_parameter_server_families_move_with_steps() -> None:
    steps = 5
    with ServerProcess(extra=[*METRICS, "--keep-jobs"]) as server:  # the job is read after its worker left
        url = metrics_url(server.url)
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
        with Worker(model, [server.url], "sync", SGD(lr=0.1), rank=0, world_size=1) as worker:
            for _ in range(steps):
                F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                worker.step()
            during = scrape(url)
        after = scrape(url)
    assert value(during, "tensorwire_ps_live_workers") == 1
    assert value(during, "tensorwire_ps_world") == 1
    assert value(after, "tensorwire_ps_live_workers", job=worker.job) == 0  # it left
    assert value(after, "tensorwire_ps_jobs") == 1
    assert value(after, "tensorwire_ps_steps_total") == steps
    assert value(after, "tensorwire_ps_pushes_applied_total") == steps
    assert value(after, "tensorwire_ps_staleness_count") == steps
    assert value(after, "tensorwire_ps_staleness_bucket", le="0") == steps  # sync: always 0
    assert value(after, "tensorwire_ps_shards") >= 1
    assert value(after, "tensorwire_ps_role", role="primary") == 1
    assert value(after, "tensorwire_requests_total", op="ps_push", transport="tcp") == steps


def test_status_shows_primary_backup_and_a_down_server(tmp_path: Path) -> None:
    down = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    peer = ["--peer-token-file", str(write_token_file(tmp_path / "peer.token"))]
    standby = ServerProcess(extra=[*METRICS, "--standby", "--failover-timeout", "30", *peer])
    with standby as backup, ServerProcess(extra=[*METRICS, "--backup", backup.url, *peer]) as primary:
        model = torch.nn.Linear(4, 2)
        replicas = [f"{primary.url}|{backup.url}"]
        with Worker(model, replicas, "async", SGD(lr=0.1), rank=0, world_size=1) as worker:
            model(torch.randn(3, 4)).sum().backward()  # type: ignore[no-untyped-call]
            worker.step()
            started = time.monotonic()
            cmd = [sys.executable, "-m", "tensorwire.cli", "status", *replicas, down]
            text = subprocess.run(
                cmd, capture_output=True, text=True, timeout=60, check=False
            )  # the real CLI
            took = time.monotonic() - started
            done = CliRunner().invoke(main, ["status", *replicas, down, "--json", "--timeout", "1"])
    assert text.returncode == 1 and done.exit_code == 1, text.stderr + done.output
    assert took < 30  # a CLI run (it imports torch), bounded by --timeout 2 s for the down server
    rows = {row["url"]: row for row in json.loads(done.stdout)}
    assert not rows[down]["up"] and rows[down]["error"]
    p, b = rows[primary.url], rows[backup.url]
    assert p["up"] and b["up"]
    assert p["summary"]["role"] == "primary @1" and b["summary"]["role"] == "backup @1"
    assert p["summary"]["workers"] == "1/1" and p["summary"]["shards"] >= 1
    assert p["status"]["ps"]["backups"][backup.url]["up"] is True
    assert p["status"]["ps"]["backups"][backup.url]["same_host"] == p["status"]["host"]  # one host
    assert p["summary"]["host"] == p["status"]["host"] and "SAME HOST" in p["summary"]["lag"]
    assert "s" in p["summary"]["lag"] and "primary" in b["summary"]["lag"]
    assert p["summary"]["requests"] > 0 and p["summary"]["rss"] > 0  # from the scraped metrics
    assert "down" in text.stdout and "primary @1" in text.stdout and "backup @1" in text.stdout
    assert "1 of" not in text.stdout and "2 of 3 servers up" in text.stdout


def test_status_of_nothing_listening_is_quick() -> None:
    started = time.monotonic()
    (node,) = collect([f"tcp://127.0.0.1:{free_port()}"], timeout=0.5)
    assert not node.up and node.error
    assert time.monotonic() - started < 5


def test_a_put_is_counted_before_its_answer_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that has its answer reads the bytes it sent in the metrics: the server counts them
    when the request begins, not after the answer (CI once read 0 there, the server thread behind)."""
    release = threading.Event()
    ending = metrics.RequestCounts.end

    def held_end(self: metrics.RequestCounts, row: metrics.Row, *args: Any, **kwargs: Any) -> None:
        if row is self.rows.get(("put", "tcp")):
            release.wait(10)  # the bookkeeping after a put's answer, held until the client has read
        ending(self, row, *args, **kwargs)

    monkeypatch.setattr(metrics.RequestCounts, "end", held_end)
    store = tensorwire.TensorStore(1 << 22)
    with tensorwire.ServerThread(["tcp://127.0.0.1:0"], store=store) as srv:
        try:
            with tensorwire.connect(srv.url, retries=0) as client:
                client.put("m/a", torch.zeros(1000))
                received = sum(row.received for (op, _), row in srv.server.counts.rows.items() if op == "put")
        finally:
            release.set()
    assert received == 4000
