"""`tensorwire bench reshard` end to end on a tiny state: 6 real rank processes (gloo), a real
server, torch.distributed.checkpoint on /dev/shm. Figures are checked for shape, never for speed."""

from __future__ import annotations

import pytest

from tensorwire.bench import report, reshard
from tensorwire.bench.reshard_ranks import Setup


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_reshard_measures_both_ways_and_moves_only_the_overlap(transport: str) -> None:
    # 4 MiB: every shard is 64 KiB or more, so over shm:// it lives in a segment (a smaller one
    # would travel inline, whole, to every reader of a view: docs/protocol.md §16)
    argv = ["--size", "4MiB", "--rows", "16", "--timeout", "120", "--json", "--transport", transport]
    result = reshard.main(argv)
    assert result["size_bytes"] == 4 << 20 and result["shape"] == [16, 8192]
    assert result["transport"] == transport
    # the server keeps 2 generations: 3 untimed rounds, the first reported on its own
    assert result["warmup_rounds"] == 3 and result["tw_cold_s"] > 0 and result["dcp_cold_s"] > 0
    assert set(result["tw_cold_phases"]) == set(result["tw_phases"])
    # steady state: every generation lands in the memory of one retired
    assert result["fresh_bytes"] == 0, result["fresh_bytes"]
    for phase in ("put4_s", "get2_s", "put2_s", "get4_s"):
        assert result["tw_phases"][phase] > 0, phase
    for phase in ("save4_s", "load2_s", "save2_s", "load4_s"):
        assert result["dcp_phases"][phase] > 0, phase
    assert result["tw_vs_dcp"] == result["tw_s"] / result["dcp_s"]
    # DCP through tensorwire.dcp (the same save4 + load2, read back bit for bit by every rank)
    # against DCP's own files on tmpfs, from the same run's dcp phases
    assert result["dcp_tw_save_s"] > 0 and result["dcp_tw_load_s"] > 0 and result["dcp_tw_cold_s"] > 0
    tmpfs = result["dcp_phases"]["save4_s"] + result["dcp_phases"]["load2_s"]
    assert result["dcp_tmpfs_s"] == tmpfs
    assert result["dcp_tw_vs_tmpfs"] == (result["dcp_tw_save_s"] + result["dcp_tw_load_s"]) / tmpfs
    # every put sends the whole state once and every get only its overlaps: 4 x the state in all
    assert result["overlap_bytes"] == 16 << 20
    # what the server's counters saw (and over shm:// what the ranks copied through segments): all
    # of it, plus layout documents
    assert 1.0 <= result["moved_vs_overlap"] < 1.05, result["moved_vs_overlap"]
    assert result["async_blocked_s"] > 0 and result["sync_put_s"] > 0
    assert result["async_blocking_ratio"] == result["async_blocked_s"] / result["sync_put_s"]
    rows = report.rows({"benchmarks": {"reshard": {"result": result}}})  # its rows in bench all's table
    by_peer = {row.peer: row for row in rows}
    assert by_peer["torch.distributed.checkpoint, /dev/shm"].ratio == result["tw_vs_dcp"]
    assert by_peer["the layouts' overlap"].ratio == result["moved_vs_overlap"]
    assert by_peer["synchronous put"].ratio == result["async_blocking_ratio"]
    assert by_peer["DCP's own files, /dev/shm"].ratio == result["dcp_tw_vs_tmpfs"]


def test_overlap_of_the_layouts_counts_each_reading_rank_once() -> None:
    setup = Setup(size=8 * 4 * 16 * 16, tensors=8, rows=16)  # 8 tensors of 16 x 16 float32
    assert setup.shape == (16, 16)
    assert reshard.overlap_bytes(setup) == 4 * setup.nbytes  # 2 puts + 2 gets, each the whole once
