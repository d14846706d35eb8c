"""The scaling benchmark's measurement, small: one server and one worker in network namespaces of
their own, bytes counted on their veth links. Skipped, with the reason, where namespaces cannot
be made (the benchmark itself reports ``skipped`` then)."""

from __future__ import annotations

import pytest

from tensorwire.bench.netns import Fabric, Unavailable
from tensorwire.bench.scaling import Job, check


def test_measured_bytes_per_step_match_the_model() -> None:
    try:
        Fabric(1).__enter__().close()
    except Unavailable as exc:
        pytest.skip(str(exc))
    result = check(Job(params=64 * 1024, servers=1, workers=1), steps=3, rate_bits=None)
    params = result["job"]["params"]
    assert result["measured_app"]["worker_sent"] == 4 * params  # a push is every gradient, fp32
    for key in ("worker_sent", "worker_received", "server_received", "server_sent"):
        # Frame headers and ACKs on top of the payload: a little more than the model, never less.
        assert 1.0 <= result["wire_over_model"][key] < 1.15, (key, result)
