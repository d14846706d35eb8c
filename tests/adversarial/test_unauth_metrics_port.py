"""The Prometheus endpoint cannot be made to hold a thread per connection (issue 13, sweep).

prometheus-client's own HTTP server starts a thread for every connection, and a thread waits for
its request with no timeout: a peer that opens connections and says nothing adds threads without
bound. A server's endpoint now serves at most ``metrics_connections`` at a time (``--metrics-
connections``), closes the rest at once, and drops a silent connection after ``auth_timeout``.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.request

import pytest

from tensorwire.server import Server, metrics
from tensorwire.server.options import ConnectionOptions, MetricsOptions, ServerOptions
from tensorwire.testing.process import wait_for


def test_silent_connections_to_the_metrics_port_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "tensorwire.server.metrics")
    server = Server(
        ServerOptions(connections=ConnectionOptions(auth_timeout=0.5), metrics=MetricsOptions(connections=4))
    )
    threads = threading.active_count()
    exporter = metrics.Exporter(
        server.registry,
        "127.0.0.1",
        0,
        max_connections=server.options.metrics.connections,
        timeout=server.options.connections.auth_timeout,
    )
    silent = [socket.create_connection(("127.0.0.1", exporter.port), timeout=5) for _ in range(64)]
    try:
        # Each accepted connection is read by a thread of its own: never more than the limit.
        most = 0

        def settled() -> bool:
            nonlocal most
            most = max(most, threading.active_count() - threads)
            return exporter.refused >= 60

        wait_for(settled, 10, "the connections beyond the limit to be closed")
        assert most <= 1 + 4, f"{most} threads for 64 silent connections"  # the accept thread, 4 readers
        # The silent ones are dropped at the deadline; then a scrape gets through again.
        wait_for(lambda: threading.active_count() <= threads + 1, 10, "the silent connections to be dropped")
        with urllib.request.urlopen(exporter.url, timeout=10) as answer:
            assert b"tensorwire_connections_refused_total" in answer.read()
        # Refusals are said, not only counted, and a flood says it in a few lines (1st, 2nd, 4th, ...).
        said = [r for r in caplog.records if "--metrics-connections" in r.getMessage()]
        assert 1 <= len(said) <= exporter.refused.bit_length(), [r.getMessage() for r in said]
    finally:
        for sock in silent:
            sock.close()
        exporter.close()
