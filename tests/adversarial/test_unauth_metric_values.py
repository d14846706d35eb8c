"""A metrics page scraped without the token shows no value a client chose (issue 32, class 10).

A server with a token serves its metrics in full only to a scrape that bears the token; any other
scrape sees the same families and series, but a job id or generation prefix only as its pseudonym
(an HMAC keyed by the token). ``tensorwire status`` (which never sends the token to the metrics
URL) still shows the real ids: it puts back the pseudonyms of the ids its STATUS answer names.
Real servers on loopback, real HTTP scrapes."""

from __future__ import annotations

import urllib.request

import torch
import torch.nn.functional as F

from tensorwire.dashboard.collect import collect
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.security import Security
from tensorwire.server import ServerThread, metrics
from tensorwire.testing.relay import PREFIX, blank_like, model_tensors, origin, publish, subscribers

TOKEN = "the-token-of-the-metric-values-test"
JOB = "secret-job-7f3a"


def scrape(url: str, token: str | None = None) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return str(answer.read().decode())


def series(page: str, name: str) -> list[dict[str, str]]:
    return [labels for labels, _ in metrics.parse(page).get(name, [])]


def test_a_scrape_without_the_token_sees_no_job_id() -> None:
    security = Security(token=TOKEN)
    with ServerThread(security=security, extensions=[ParamServer()], metrics_port=0) as srv:
        model = torch.nn.Linear(4, 2)
        with Worker(model, [srv.url], "sync", SGD(lr=0.1), rank=0, world_size=1, job=JOB, token=TOKEN) as w:
            F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()  # type: ignore[no-untyped-call]
            w.step()
            exporter = srv.server.exporter
            assert exporter is not None
            public, wrong = scrape(exporter.url), scrape(exporter.url, "guess")
            full = scrape(exporter.url, TOKEN)
            (node,) = collect([srv.url], timeout=10, token=TOKEN)
    assert JOB in full
    for page in (public, wrong):
        assert JOB not in page
        assert series(page, "tensorwire_ps_steps_total") == [{"job": metrics.pseudonym(TOKEN, JOB)}]
        assert len(metrics.parse(page)) == len(metrics.parse(full))  # the same families, the same series
        assert series(page, "tensorwire_requests_total") == series(full, "tensorwire_requests_total")
    assert node.value("tensorwire_ps_steps_total", job=JOB) == 1  # status maps the pseudonym back


def test_a_scrape_without_the_token_sees_no_generation_prefix() -> None:
    with origin(TOKEN) as (srv, _):
        exporter = metrics.Exporter(srv.server.registry, "127.0.0.1", 0, token=TOKEN)
        try:
            model = model_tensors(1)
            publish(srv.url, model, token=TOKEN)
            with subscribers(srv.url, PREFIX, [blank_like(model)], token=TOKEN) as (sub,):
                sub.update(timeout=30)
            public, full = scrape(exporter.url), scrape(exporter.url, TOKEN)
        finally:
            exporter.close()
    assert series(full, "tensorwire_relay_served_bytes_total") == [{"prefix": PREFIX}]
    assert PREFIX not in public
    masked = metrics.pseudonym(TOKEN, PREFIX)
    assert series(public, "tensorwire_relay_served_bytes_total") == [{"prefix": masked}]
