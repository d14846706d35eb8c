"""`tensorwire bench broadcast` in network namespaces, small: the origin and 2 readers each a host
of its own, links shaped to 1 Gb/s, the origin's bytes counted on its veth. Skipped, with the
reason, where namespaces cannot be made (the benchmark itself reports ``skipped`` then)."""

from __future__ import annotations

import json

import pytest

from tensorwire.bench import broadcast


def test_bench_broadcast_in_network_namespaces(capsys: pytest.CaptureFixture[str]) -> None:
    """Needs root (CAP_NET_ADMIN) and `ip`/`tc`: skipped, with the reason, where either is missing."""
    result = broadcast.main(
        [
            "--readers",
            "2",
            "--size",
            "4MiB",
            "--tensors",
            "12",
            "--timeout",
            "60",
            "--mixed-seconds",
            "1",
            "--json",
        ]
    )
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["network"] == "netns" and result["rate_gbit"] == 1.0
    link = result["link_s"]
    assert result["bound_s"] == pytest.approx({"single": link, "star": 2 * link, "fanout": link})
    assert result["star_s"] >= 0.9 * result["bound_s"]["star"]  # the links are really shaped
    for mode, copies in (("single", 1), ("star", 2), ("fanout", 1)):  # fanout: the relay forwards
        # Counted on the origin's veth: the model's bytes, once per reader, plus headers.
        assert copies <= result["origin_egress_ratio"][mode] < copies * 1.1, result
    assert "rate_note" in result
    # delta: counted on the origin's veth too (headers and the request's answer frame included)
    assert result["delta_bytes_source"].startswith("origin egress") and result["delta_bytes_ratio"] <= 0.05
    # the relay's readers listen on their namespaces' addresses; a kill and a busy publisher change nothing
    assert result["killed_reader_ok"] is True and result["killed_routed_around"] >= 1, result
    assert result["mixed_reads"] == 0 < result["reads"], result
