"""A metrics page shows the values clients chose only to Prometheus's own read-only secret (issue 32,
class 10; review 2 #1 and #2).

A server that asks its clients for a token or a certificate serves its metrics in full only to a
scrape that bears its metrics token (``--metrics-token-file``); a scrape bearing anything else (the
clients' token above all: the endpoint is plain HTTP, and whoever saw that token could write and
delete tensors) is refused, and one with no bearer sees the same families and series with each job
id or generation prefix as a pseudonym. ``tensorwire status`` (which sends no secret to the metrics
URL) still shows the real ids: it puts back the pseudonyms of the ids its STATUS answer names, under
the key that (authenticated) answer carries. Real servers on loopback, real HTTP scrapes."""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from tensorwire import cli
from tensorwire.dashboard.collect import collect
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.security import TlsFiles, write_dev_certs, write_token_file
from tensorwire.server import ServerThread, metrics
from tensorwire.server.options import MetricsOptions, ServerOptions
from tensorwire.testing.relay import PREFIX, blank_like, model_tensors, origin, publish, subscribers

TOKEN = "the-token-of-the-metric-values-test"
METRICS_TOKEN = "the-scrape-token-of-the-metric-values-test"
JOB = "secret-job-7f3a"


def scrape(url: str, token: str | None = None) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return str(answer.read().decode())


def refused(url: str, token: str) -> int:
    with pytest.raises(urllib.error.HTTPError) as caught:
        scrape(url, token)
    return caught.value.code


def series(page: str, name: str) -> list[dict[str, str]]:
    return [labels for labels, _ in metrics.parse(page).get(name, [])]


@contextlib.contextmanager
def job_at_step_one(url: str, **client: object) -> Iterator[None]:
    """Job ``JOB`` after one step, while its worker is still in it (the job ends when it leaves)."""
    model = torch.nn.Linear(4, 2)
    with Worker(model, [url], "sync", SGD(lr=0.1), rank=0, world_size=1, job=JOB, **client) as w:  # type: ignore[arg-type]
        F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()  # type: ignore[no-untyped-call]
        w.step()
        yield


def test_only_the_metrics_token_sees_job_ids_never_the_clients_token() -> None:
    """Before, the full page took the clients' token as its bearer (and the docs told operators to
    give Prometheus that token, over plain HTTP)."""
    options = ServerOptions(token=TOKEN, metrics=MetricsOptions(port=0, token=METRICS_TOKEN))
    with (
        ServerThread(options=options, extensions=[ParamServer()]) as srv,
        job_at_step_one(srv.url, token=TOKEN),
    ):
        exporter = srv.server.exporter
        assert exporter is not None
        public, full = scrape(exporter.url), scrape(exporter.url, METRICS_TOKEN)
        assert refused(exporter.url, TOKEN) == 401  # the data token is no scrape credential
        assert refused(exporter.url, "guess") == 401
        (node,) = collect([srv.url], timeout=10, token=TOKEN)
        refusals = metrics.parse(scrape(exporter.url, METRICS_TOKEN))["tensorwire_connections_refused_total"]
    assert JOB in full
    assert JOB not in public
    key = metrics.pseudonym_key(TOKEN)
    assert series(public, "tensorwire_ps_steps_total") == [{"job": metrics.pseudonym(key, JOB)}]
    assert len(metrics.parse(public)) == len(metrics.parse(full))  # the same families, the same series
    assert series(public, "tensorwire_requests_total") == series(full, "tensorwire_requests_total")
    assert ({"reason": "metrics_auth"}, 2.0) in refusals  # each refused bearer counted
    assert node.value("tensorwire_ps_steps_total", job=JOB) == 1  # status maps the pseudonym back
    assert node.status is not None and "metrics_key" not in node.status  # used, never shown


def test_a_server_secured_by_client_certificates_only_shows_no_job_id(tmp_path: Path) -> None:
    """Before, a server with --tls-client-ca and no token served its full page to anyone."""
    paths = write_dev_certs(tmp_path)
    served = TlsFiles(paths["server"], paths["server_key"], paths["ca"])
    client = TlsFiles(paths["client"], paths["client_key"], paths["ca"])
    urls = ("tls://127.0.0.1:0",)
    with (
        ServerThread(
            urls,
            ServerOptions(tls=served, metrics=MetricsOptions(port=0)),
            extensions=[ParamServer()],
        ) as srv,
        job_at_step_one(srv.url, tls=client),
    ):
        exporter = srv.server.exporter
        assert exporter is not None
        public = scrape(exporter.url)
        (node,) = collect([srv.url], timeout=10, tls=client)
    assert JOB not in public
    (masked,) = series(public, "tensorwire_ps_steps_total")
    assert masked["job"].startswith(metrics.PSEUDONYM_PREFIX)
    assert node.value("tensorwire_ps_steps_total", job=JOB) == 1  # status still shows the real id


def test_a_scrape_without_the_metrics_token_sees_no_generation_prefix() -> None:
    with origin(TOKEN) as (srv, _):
        key = metrics.pseudonym_key(TOKEN)
        exporter = metrics.Exporter(srv.server.registry, "127.0.0.1", 0, scrape_token=METRICS_TOKEN, key=key)
        try:
            model = model_tensors(1)
            publish(srv.url, model, token=TOKEN)
            with subscribers(srv.url, PREFIX, [blank_like(model)], token=TOKEN) as (sub,):
                sub.update(timeout=30)
            public, full = scrape(exporter.url), scrape(exporter.url, METRICS_TOKEN)
        finally:
            exporter.close()
    assert series(full, "tensorwire_relay_served_bytes_total") == [{"prefix": PREFIX}]
    assert PREFIX not in public
    masked = metrics.pseudonym(key, PREFIX)
    assert series(public, "tensorwire_relay_served_bytes_total") == [{"prefix": masked}]


def test_the_pseudonym_key_is_no_secret_a_client_could_use() -> None:
    """STATUS carries the key: it must not be the token, nor guessable without one."""
    key = metrics.pseudonym_key(TOKEN, METRICS_TOKEN)
    assert key == metrics.pseudonym_key(TOKEN) != metrics.pseudonym_key(METRICS_TOKEN)  # stable, by token
    assert TOKEN not in key and METRICS_TOKEN not in key
    assert metrics.pseudonym_key(None, None) != metrics.pseudonym_key(None, None)  # random per process


def test_serve_refuses_a_metrics_token_that_is_another_secret(tmp_path: Path) -> None:
    token = write_token_file(tmp_path / "token", "the-same-secret-of-the-metrics-test")
    for others in (["--token-file", str(token)], ["--operator-token-file", str(token)]):
        argv = ["ps", "serve", *others, "--metrics-port", "0", "--metrics-token-file", str(token)]
        answer = CliRunner().invoke(cli.main, argv)
        assert answer.exit_code == 2 and "--metrics-token-file must differ" in answer.output, answer.output
    with pytest.raises(ValueError, match="metrics token"):
        ServerThread(options=ServerOptions(token=TOKEN, metrics=MetricsOptions(port=0, token=TOKEN)))
