"""docs/reference/metrics.md names every Prometheus metric a server exports, and no other.

The metrics are found in the source: every ``*MetricFamily(NAME, ...)`` call in ``src/`` (and every
call of a helper that takes the name first, ``_labelled("tensorwire_...", ...)``). A name written
as an f-string over a loop (``f"tensorwire_ps_{name}"`` for ``name, ...`` in a table) is expanded
from the table. Then the page must show each name, as itself or with ``_total`` (how a counter is
exported), and each ``tensorwire_*`` name on the page must be one of them (give or take the
``_total``, ``_bucket``, ``_sum`` and ``_count`` that the exposition adds). A live scrape would miss
the families a server exports only in some roles (a backup's, a primary's with backups), which is
why the source is read instead; ``test_a_scrape_shows_only_names_the_scan_found`` checks the
scan against a real server.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "tensorwire"
PAGE = ROOT / "docs" / "reference" / "metrics.md"
METRIC = re.compile(r"^tensorwire_[a-z0-9_]+$")
ON_PAGE = re.compile(r"\btensorwire_[a-z0-9_]+")
SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts)


def _loop_values(tree: ast.AST, call: ast.Call, var: str, path: Path) -> list[str]:
    """The values ``var`` takes in the ``for`` loop around ``call`` (its first target element)."""
    for loop in ast.walk(tree):
        if not isinstance(loop, ast.For) or call not in list(ast.walk(loop)):
            continue
        target = loop.target
        first = target.elts[0] if isinstance(target, ast.Tuple) else target
        if not (isinstance(first, ast.Name) and first.id == var):
            continue
        if isinstance(loop.iter, ast.Tuple | ast.List):  # a table written in the loop
            rows = loop.iter.elts
            return [
                row.elts[0].value if isinstance(row, ast.Tuple) else row.value  # type: ignore[attr-defined]
                for row in rows
            ]
        if isinstance(loop.iter, ast.Name):  # a module-level table
            table = getattr(importlib.import_module(_module_of(path)), loop.iter.id)
            return [row[0] if isinstance(row, tuple) else row for row in table]
    raise AssertionError(f"{path}: cannot expand the metric name over {var!r} (line {call.lineno})")


def _names_of(call: ast.Call, tree: ast.AST, path: Path) -> list[str]:
    if not call.args:
        return []
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str) and METRIC.match(first.value):
        return [first.value]
    if isinstance(first, ast.JoinedStr):
        parts = first.values
        head = parts[0] if parts else None
        if (
            len(parts) == 2
            and isinstance(head, ast.Constant)
            and str(head.value).startswith("tensorwire_")
            and isinstance(parts[1], ast.FormattedValue)
            and isinstance(parts[1].value, ast.Name)
        ):
            return [str(head.value) + v for v in _loop_values(tree, call, parts[1].value.id, path)]
        if isinstance(head, ast.Constant) and str(head.value).startswith("tensorwire_"):
            raise AssertionError(f"{path}:{call.lineno}: a metric name this test cannot expand")
    return []


@functools.cache
def defined_metrics() -> frozenset[str]:
    """Every metric family name the source builds."""
    found: set[str] = set()
    for path in sorted(SRC.rglob("*.py")):
        if "bench" in path.relative_to(SRC).parts:  # the benchmarks read metrics, never export them
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func
                name = str(getattr(func, "id", None) or getattr(func, "attr", ""))
                if name.endswith("MetricFamily") or name == "_labelled":
                    found.update(_names_of(node, tree, path))
    return frozenset(found)


def _base(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name.removesuffix(suffix) in defined_metrics():
            return name.removesuffix(suffix)
    return name


def test_the_scan_finds_the_families_of_every_collector() -> None:
    found = defined_metrics()
    assert {
        "tensorwire_requests",  # server/metrics.py, a counter in a loop table
        "tensorwire_connections_refused",  # through _labelled
        "tensorwire_ps_steps",  # ps/server/metrics.py, a module-level table
        "tensorwire_ps_epoch",
        "tensorwire_ps_primary_silence_seconds",  # a backup's only
        "tensorwire_relay_served_bytes",  # broadcast/coordinator.py
    } <= found
    assert len(found) >= 55  # 57 when this was written


def test_every_metric_is_on_the_page() -> None:
    page = PAGE.read_text()
    missing = sorted(n for n in defined_metrics() if not re.search(rf"\b{n}(_total)?\b", page))
    assert not missing, f"docs/reference/metrics.md lacks {missing}"


def test_every_metric_on_the_page_exists() -> None:
    named = {_base(m.group(0)) for m in ON_PAGE.finditer(PAGE.read_text())}
    stale = sorted(named - defined_metrics())
    assert not stale, f"docs/reference/metrics.md names metrics that src does not export: {stale}"


def test_a_scrape_shows_only_names_the_scan_found() -> None:
    pytest.importorskip("prometheus_client")
    import torch

    import tensorwire
    from tensorwire import ps
    from tensorwire.broadcast.coordinator import RelayCoordinator
    from tensorwire.server.core import ServerThread
    from tensorwire.server.options import MetricsOptions

    options = tensorwire.ServerOptions(metrics=MetricsOptions(port=0))
    with ServerThread(["tcp://127.0.0.1:0"], options, extensions=[ps.ParamServer()]) as srv:
        RelayCoordinator.of(srv.server)
        with tensorwire.connect(srv.url) as client:
            client.put("x", torch.zeros(4))
        exporter = srv.server.exporter
        assert exporter is not None
        with urllib.request.urlopen(exporter.url, timeout=10) as answer:
            text = answer.read().decode()
    scraped = set(re.findall(r"^# TYPE (tensorwire_\w+) ", text, re.MULTILINE))
    assert scraped, "the scrape shows no tensorwire family"
    unknown = sorted(n for n in scraped if _base(n) not in defined_metrics())
    assert not unknown, f"a scrape shows families the scan of src/ missed: {unknown}"
