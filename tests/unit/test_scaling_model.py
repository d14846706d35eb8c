"""The bytes-per-step model of docs/explanation/scaling.md (tensorwire.bench.scaling): its numbers for
jobs one can count by hand, and the table the doc embeds."""

from __future__ import annotations

import pytest

from tensorwire.bench import scaling
from tensorwire.bench.scaling import Job, step_time, traffic


def test_traffic_counts_push_pull_and_replication_bytes() -> None:
    t = traffic(Job(params=1000, servers=2, workers=4, replicas=1, push=2.0, pull=4.0))
    assert t["worker_sent"] == 2000 and t["worker_received"] == 4000
    assert t["server_received"] == 4 * 2000 / 2  # each primary: its half of every worker's push
    assert t["server_sent"] == 4 * 4000 / 2 + 1 * 4 * 2000 / 2  # pulls + the pushes forwarded to its backup
    assert t["backup_received"] == 4000
    assert t["network_total"] == 4 * 6000 + 4 * 2000


def test_step_time_is_bound_by_the_busiest_link() -> None:
    few_servers = step_time(Job(10**6, 1, 8), link_bytes_per_s=1e9)
    assert few_servers["bound"] == "server NIC" and few_servers["step_s"] == pytest.approx(2 * 8 * 4e6 / 1e9)
    many = step_time(Job(10**6, 16, 8), link_bytes_per_s=1e9, compute_s=0.5)
    assert many["bound"] == "worker NIC" and many["step_s"] == pytest.approx(0.5 + 2 * 4e6 / 1e9)
    backed = step_time(Job(10**6, 1, 8, replicas=1), link_bytes_per_s=1e9)  # + forwarding the last push
    assert backed["push_s"] == pytest.approx(9 * 4e6 / 1e9)
    assert backed["pull_s"] == pytest.approx(8 * 4e6 / 1e9)
    two = step_time(Job(10**6, 1, 8, replicas=2), link_bytes_per_s=1e9)  # 16 shards out after the first in
    assert two["push_s"] == pytest.approx(17 * 4e6 / 1e9)


def test_the_table_has_a_row_per_codec_and_layout(capsys: pytest.CaptureFixture[str]) -> None:
    scaling.main(["--table", "1e8", "16", "25"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 + 4 * len(scaling.CODECS)
    assert lines[2].startswith("| fp32 | 4 | 1 | 0 | 400.0 MB | 6,400.0 MB |")
