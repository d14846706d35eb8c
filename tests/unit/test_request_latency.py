"""``tensorwire_request_duration_seconds``: each timed request lands in its bucket, and the
family the collector builds is the cumulative histogram Prometheus (and the dashboard) reads."""

from __future__ import annotations

import time

from prometheus_client import generate_latest

import tensorwire
from tensorwire.server import ServerThread, metrics
from tensorwire.server.options import MetricsOptions, ServerOptions


def test_a_timed_request_lands_in_its_bucket() -> None:
    counts = metrics.RequestCounts()
    for seconds in (0.00005, 0.0003, 0.0003, 20.0):
        counts.end(counts.begin("put", "tcp"), 0, False, seconds)
    counts.end(counts.begin("put", "tcp"), 0, False)  # not timed: counted, not in the histogram
    row = counts.rows[("put", "tcp")]
    assert row.requests == 5 and sum(row.latency) == 4
    assert row.latency[0] == 1 and row.latency[metrics.LATENCY_BUCKETS.index(0.0005)] == 2
    assert row.latency[-1] == 1  # above the last bound: only in +Inf
    assert abs(row.seconds - 20.00065) < 1e-9


def test_the_histogram_is_exported_cumulative_per_op_and_transport() -> None:
    with ServerThread(options=ServerOptions(metrics=MetricsOptions(port=0))) as server:
        with tensorwire.connect(server.url) as client:
            client.list("")
        # The server counts a request once its answer is out, so the client may hear it first.
        deadline = time.monotonic() + 5
        while not server.server.counts.rows.get(("list", "tcp"), metrics.Row()).seconds:
            assert time.monotonic() < deadline, "the LIST was never counted"
            time.sleep(0.01)
        samples = metrics.parse(generate_latest(server.server.registry).decode())
    buckets = {
        labels["le"]: value
        for labels, value in samples["tensorwire_request_duration_seconds_bucket"]
        if labels["op"] == "list" and labels["transport"] == "tcp"
    }
    assert list(buckets)[-1] == "+Inf" and buckets["+Inf"] == 1.0
    values = list(buckets.values())
    assert values == sorted(values)  # cumulative
    (count,) = [
        v for labels, v in samples["tensorwire_request_duration_seconds_count"] if labels["op"] == "list"
    ]
    assert count == 1.0
