"""``deploy/grafana/tensorwire.json``: a Grafana dashboard over the metrics the servers export.
Every metric name in its expressions must be one a real server exports (read from the families
of live servers: a primary with a backup, the standby backup, a job)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.security import Security
from tensorwire.server import ServerThread

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "tensorwire.json"
PEER = Security(token="the-peer-token-of-the-grafana-test")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}


def expressions(doc: Any) -> list[str]:
    """Every ``expr`` in the dashboard: panel targets and annotations."""
    found: list[str] = []
    if isinstance(doc, dict):
        found += [v for k, v in doc.items() if k == "expr" and isinstance(v, str)]
        for value in doc.values():
            found += expressions(value)
    elif isinstance(doc, list):
        for value in doc:
            found += expressions(value)
    return found


def exported(server: ServerThread) -> set[str]:
    """The sample names the server's metrics page can hold (families, with their suffixes)."""
    names = set()
    for family in text_string_to_metric_families(generate_latest(server.server.registry).decode()):
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
    return names


def test_every_expression_names_a_metric_the_servers_export() -> None:
    doc = json.loads(DASHBOARD.read_text())
    exprs = expressions(doc)
    assert len(exprs) >= 20
    with ServerThread(extensions=[ParamServer(standby=True, peer=PEER, failover_timeout=30)]) as backup:
        primary_ps = ParamServer(backups=[backup.url], peer=PEER)
        with ServerThread(extensions=[primary_ps]) as primary:
            net = torch.nn.Linear(4, 2)
            with Worker(
                net, [f"{primary.url}|{backup.url}"], "async", SGD(lr=0.1), rank=0, timeout=30
            ) as worker:
                net(torch.randn(3, 4)).sum().backward()  # type: ignore[no-untyped-call]
                worker.step()
            names = exported(primary) | exported(backup)
    used = {
        name for expr in exprs for name in re.findall(r"\b(tensorwire_[a-z0-9_]+|process_[a-z0-9_]+)", expr)
    }
    assert used, exprs
    assert used <= names, sorted(used - names)
    for panel in doc["panels"]:
        assert panel.get("gridPos") and panel.get("title")


def test_the_description_gives_prometheus_the_metrics_token_never_the_clients() -> None:
    """Job ids are shown to a scrape bearing the servers' metrics token; the clients' token (which
    writes and deletes tensors) is refused on the plain-HTTP metrics port, so the dashboard must not
    tell anyone to give it to Prometheus (it did: "credentials_file: the token file")."""
    description = json.loads(DASHBOARD.read_text())["description"]
    assert "--metrics-token-file" in description and "auth.metricsToken" in description
    assert "credentials_file: the token file" not in description
