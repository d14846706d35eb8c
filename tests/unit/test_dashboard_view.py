"""The dashboard's view model from canned STATUS answers and metric pages: what the page shows,
rates between two snapshots, and the events seen between them (a failover, a server down)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tensorwire.dashboard.collect import Node
from tensorwire.dashboard.view import View, percentile, slots_of
from tensorwire.server import metrics

PRIMARY, BACKUP, OTHER = "tcp://10.0.0.1:7070", "tcp://10.0.0.2:7070", "tcp://10.0.0.3:7070"


def status(role: str, epoch: int, *, jobs: dict[str, Any] | None = None, stored: int = 0) -> dict[str, Any]:
    ps: dict[str, Any] = {"role": role, "epoch": epoch, "jobs": jobs or {}, "capacity": 1 << 20,
                          "held_bytes": {"params": 1000, "optimizer": 2000}}  # fmt: skip
    if role == "primary":
        ps["backups"] = {BACKUP: {"up": True, "lag_s": 0.2, "behind": 0}}
    return {
        "host": "node-a",
        "store": {"tensors": 3, "bytes": stored, "capacity": 1 << 30},
        "connections": 2,
        "in_flight": 0,
        "requests": 10,
        "ps": ps,
        "generations": {"prefixes": 1, "newest": {"model/": 7}},
        "relay": {"readers": 2, "readers_by_prefix": {"model/": 2}},
    }


def page(received: float, sent: float, requests: float, fast: float, slow: float, **extra: float) -> str:
    """A metrics page: bytes and requests on tcp, ``fast`` requests under 1 ms and ``slow`` ones
    between 10 and 25 ms, and a job's counters."""
    lines = [
        f'tensorwire_received_bytes_total{{op="put",transport="tcp"}} {received}',
        f'tensorwire_sent_bytes_total{{op="get",transport="tcp"}} {sent}',
        f'tensorwire_requests_total{{op="put",transport="tcp"}} {requests}',
        f'tensorwire_checksum_failures_total{{transport="tcp"}} {extra.get("corrupt", 0)}',
        f'tensorwire_ps_pushes_applied_total{{job="j1"}} {extra.get("pushes", 0)}',
        f'tensorwire_ps_workers_dropped_total{{job="j1"}} {extra.get("dropped", 0)}',
        f'tensorwire_ps_live_workers{{job="j1"}} {extra.get("live", 2)}',
        'tensorwire_ps_staleness_bucket{job="j1",le="0.0"} 5',
        'tensorwire_ps_staleness_bucket{job="j1",le="1.0"} 8',
        'tensorwire_ps_staleness_bucket{job="j1",le="+Inf"} 9',
    ]
    for bound in metrics.LATENCY_BUCKETS:
        count = fast if bound >= 0.001 else 0
        count += slow if bound >= 0.025 else 0
        lines.append(
            f'tensorwire_request_duration_seconds_bucket{{op="put",transport="tcp",le="{bound!r}"}} {count}'
        )
    lines.append(
        f'tensorwire_request_duration_seconds_bucket{{op="put",transport="tcp",le="+Inf"}} {fast + slow}'
    )
    return "\n".join(lines) + "\n"


JOB = {"j1": {"mode": "sync", "world": 2, "live": 2, "step": 40, "pushes_applied": 80,
              "optimizer": {"kind": "adam", "lr": 0.001}}}  # fmt: skip


def node(url: str, doc: dict[str, Any], text: str = "") -> Node:
    return Node(url, status=doc, samples=metrics.parse(text) if text else {})


def test_slots_are_read_off_the_command_line() -> None:
    assert slots_of([f"{PRIMARY}|{BACKUP}", "10.0.0.3:7070"]) == [[PRIMARY, BACKUP], [OTHER]]
    assert slots_of([f"{PRIMARY}|{BACKUP},{OTHER}"]) == [[PRIMARY, BACKUP], [OTHER]]


def test_a_cluster_of_two_slots_is_shown_with_rates_jobs_and_generations() -> None:
    view = View(slots_of([f"{PRIMARY}|{BACKUP}", OTHER]))
    first = [node(PRIMARY, status("primary", 1, jobs=JOB), page(0, 0, 0, 0, 0, pushes=0)),
             node(BACKUP, status("backup", 1)), node(OTHER, status("primary", 1, stored=512))]  # fmt: skip
    view.update(first, 100.0)
    second = [node(PRIMARY, status("primary", 1, jobs=JOB), page(4096, 2048, 90, 90, 10, pushes=20)),
              node(BACKUP, status("backup", 1)), node(OTHER, status("primary", 1, stored=512))]  # fmt: skip
    doc = view.update(second, 102.0)

    assert (doc["up"], doc["total"]) == (3, 3)
    assert [s["primary"] for s in doc["slots"]] == [PRIMARY, OTHER]
    assert [r["role"] for r in doc["slots"][0]["replicas"]] == ["primary", "backup"]
    rates = doc["servers"][0]["rates"]
    assert rates["in_bps"] == 2048 and rates["out_bps"] == 1024 and rates["req_s"] == 45
    assert rates["by_transport"] == {"tcp": {"in_bps": 2048, "out_bps": 1024}}
    assert 0.1 < rates["p50_ms"] <= 1.0  # 90 of 100 under 1 ms
    assert 10.0 <= rates["p99_ms"] <= 25.0  # the slow tenth
    assert len(doc["servers"][0]["history"]) == 2
    other = doc["servers"][2]
    assert (other["stored"], other["capacity"], other["tensors"], other["connections"]) == (
        512,
        1 << 30,
        3,
        2,
    )
    (job,) = doc["jobs"]  # the backup's copy of the job is not another job
    assert job["job"] == "j1" and job["mode"] == "sync" and job["step"] == 40
    assert (job["live"], job["world"], job["pushes_s"], job["optimizer"]) == (2, 2, 10.0, "adam lr=0.001")
    assert job["staleness"] == [["0", 5.0], ["1", 3.0], ["inf", 1.0]]
    assert {"prefix": "model/", "newest": 7, "readers": 2, "server": PRIMARY} in doc["generations"]
    assert doc["timeline"] == []
    json.dumps(doc)  # what the page gets is plain JSON


def test_a_failover_between_two_snapshots_is_on_the_timeline() -> None:
    view = View(slots_of([f"{PRIMARY}|{BACKUP}"]))
    view.update([node(PRIMARY, status("primary", 1)), node(BACKUP, status("backup", 1))], 10.0)
    down = Node(PRIMARY, error="cannot connect to tcp://10.0.0.1:7070: Connection refused")
    doc = view.update([down, node(BACKUP, status("primary", 2))], 11.0)

    (slot,) = doc["slots"]
    assert (slot["primary"], slot["epoch"], slot["up"]) == (BACKUP, 2, True)
    assert slot["replicas"][0]["up"] is False and "Connection refused" in slot["replicas"][0]["error"]
    kinds = {(e["kind"], e["server"]) for e in doc["timeline"]}
    assert kinds == {("down", PRIMARY), ("failover", BACKUP)}
    failover = next(e for e in doc["timeline"] if e["kind"] == "failover")
    assert "epoch 2" in failover["text"] and failover["t"] == 11.0


def test_a_failover_seen_only_after_the_backup_answered_again_is_still_one() -> None:
    """Under load a probe can time out: the backup, down for one snapshot, comes back as primary."""
    view = View([[PRIMARY, BACKUP]])
    view.update([node(PRIMARY, status("primary", 1)), node(BACKUP, status("backup", 1))], 1.0)
    view.update([Node(PRIMARY, error="refused"), Node(BACKUP, error="waited 2s for the HELLO answer")], 2.0)
    doc = view.update([Node(PRIMARY, error="refused"), node(BACKUP, status("primary", 2))], 3.0)
    assert [e["kind"] for e in doc["timeline"]] == ["down", "down", "up", "failover"]


def test_a_backup_following_its_primarys_epoch_is_no_failover() -> None:
    view = View([[PRIMARY, BACKUP]])
    view.update([node(PRIMARY, status("primary", 1)), node(BACKUP, status("backup", 0))], 1.0)
    doc = view.update([node(PRIMARY, status("primary", 1)), node(BACKUP, status("backup", 1))], 2.0)
    assert doc["timeline"] == []


def test_a_server_down_from_the_start_is_a_row_with_its_reason() -> None:
    view = View([[PRIMARY], [OTHER]])
    doc = view.update(
        [Node(PRIMARY, error="waited 1s for the HELLO answer"), node(OTHER, status("primary", 1))], 5.0
    )
    row = doc["servers"][0]
    assert row["up"] is False and row["error"] == "waited 1s for the HELLO answer"
    assert row["rates"]["in_bps"] is None and row["role"] is None
    assert (doc["up"], doc["slots"][0]["up"], doc["slots"][1]["up"]) == (1, False, True)
    assert doc["timeline"][0]["kind"] == "down" and "HELLO" in doc["timeline"][0]["text"]


def test_dropped_and_rejoined_workers_and_checksum_failures_are_events() -> None:
    view = View([[PRIMARY]])
    view.update([node(PRIMARY, status("primary", 1, jobs=JOB), page(0, 0, 0, 0, 0, live=2))], 1.0)
    doc = view.update(
        [node(PRIMARY, status("primary", 1, jobs=JOB), page(0, 0, 0, 0, 0, live=1, dropped=1))], 2.0
    )
    assert [e["kind"] for e in doc["timeline"]] == ["dropped"]
    later = page(0, 0, 0, 0, 0, live=2, dropped=1, corrupt=3)
    doc = view.update([node(PRIMARY, status("primary", 1, jobs=JOB), later)], 3.0)
    assert [e["kind"] for e in doc["timeline"]] == ["dropped", "checksum", "rejoined"]
    assert "3 chunk(s)" in doc["timeline"][1]["text"]


def test_a_restarted_server_counts_its_rates_from_zero() -> None:
    view = View([[PRIMARY]])
    view.update([node(PRIMARY, status("primary", 1), page(10_000, 0, 50, 0, 0))], 1.0)
    doc = view.update([node(PRIMARY, status("primary", 1), page(100, 0, 5, 0, 0))], 2.0)
    assert doc["servers"][0]["rates"]["in_bps"] == 100 and doc["servers"][0]["rates"]["req_s"] == 5


def test_strings_a_server_sent_are_kept_as_data() -> None:
    """The page sets these as text: the view neither drops nor interprets markup in them."""
    evil = status("primary", 1, jobs={"<img src=x onerror=alert(1)>": {"mode": "<b>sync</b>", "step": 1}})
    doc = View([[PRIMARY]]).update([node(PRIMARY, evil)], 1.0)
    assert doc["jobs"][0]["job"] == "<img src=x onerror=alert(1)>" and doc["jobs"][0]["mode"] == "<b>sync</b>"


@pytest.mark.parametrize(
    ("before", "now", "q", "expected"),
    [
        ({1.0: 0, 2.0: 0, float("inf"): 0}, {1.0: 50, 2.0: 100, float("inf"): 100}, 0.5, 1.0),
        ({1.0: 0, 2.0: 0, float("inf"): 0}, {1.0: 50, 2.0: 100, float("inf"): 100}, 0.75, 1.5),
        ({1.0: 0, float("inf"): 0}, {1.0: 0, float("inf"): 10}, 0.99, 1.0),  # above every bound
        ({1.0: 5, float("inf"): 5}, {1.0: 5, float("inf"): 5}, 0.5, None),  # nothing timed
    ],
)
def test_percentiles_interpolate_within_a_bucket(
    before: dict[float, float], now: dict[float, float], q: float, expected: float | None
) -> None:
    assert percentile(before, now, q) == expected
