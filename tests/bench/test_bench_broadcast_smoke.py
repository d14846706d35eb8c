"""`tensorwire bench broadcast` end to end, tiny, on loopback (it runs everywhere): a real origin
server, the published state_dict, reader processes checked bit-exact. In network namespaces:
tests/fault/test_broadcast_netns.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorwire.bench import broadcast, broadcast_harness, broadcast_readers

TINY = ["--readers", "2", "--size", "1MiB", "--tensors", "12", "--timeout", "60", "--mixed-seconds", "0.5"]


def test_layout_is_transformer_like_and_within_the_size() -> None:
    lay = broadcast_readers.layout(256 << 20, 75)
    assert len(lay) == 75 and {dtype for _, dtype, _ in lay} == {torch.bfloat16, torch.float32}
    assert 0.95 * (256 << 20) < broadcast_readers.model_bytes(lay) <= 256 << 20
    assert broadcast_readers.model_bytes(broadcast_readers.layout(1 << 20, 12)) <= 1 << 20


def test_bench_broadcast_on_loopback_measures_every_mode() -> None:
    result = broadcast.main(["--no-netns", *TINY])
    assert result["network"].startswith("loopback") and "skipped" not in result
    assert result["readers"] == 2 and result["tensors"] == 12 and result["model_bytes"] <= 1 << 20
    assert result["single_s"] > 0 and result["star_s"] > 0 and len(result["star_reader_s"]) == 2
    assert result["star_vs_single"] == result["star_s"] / result["single_s"]
    # delta: the next generation (1% changed) read against the one before, checked bit-exact
    assert result["delta_s"] > 0 and result["delta_bytes_source"].startswith("client")
    assert 0 < result["delta_bytes"] == result["delta_bytes_ratio"] * result["model_bytes"]
    assert result["delta_bytes_ratio"] <= 0.05
    assert result["delta_chunks"]["full_chunks"] == result["delta_chunks"]["refetched"] == 0
    # fanout: both readers through the relay, checked bit-exact like the others
    assert result["fanout_s"] > 0 and len(result["fanout_reader_s"]) == 2
    assert result["fanout_vs_single"] == result["fanout_s"] / result["single_s"]
    # mixed: a publisher publishing while the readers read; every read checked, none mixed
    assert result["mixed_reads"] == 0 < result["reads"] and result["mixed_generations"] >= 1
    # killed: one of the two kill -9'd after its first chunk, the other finished bit-exact
    assert result["killed_reader_ok"] is True and len(result["killed_reader_s"]) == 1, result
    assert result["killed_routed_around"] >= 1  # the survivor was strung behind the victim
    # Nothing for what loopback cannot count: reasons instead.
    assert set(result["not_measured"]) == {"origin_egress", "bound_s"}
    assert not {"origin_egress_ratio", "bound_s", "rate_gbit"} & set(result)


def test_a_mixed_read_is_counted() -> None:
    """The check behind ``mixed_reads`` finds a read whose tensors carry two generations' tags, or
    whose bytes are not what was published as the generation it returned."""
    lay = broadcast_readers.layout(1 << 16, 12)
    tensors = broadcast_readers.empty_state_dict(lay)
    published = {}
    for k in (1, 2):
        broadcast_readers.fill(tensors, k)
        published[10 + k] = {"digests": broadcast_readers.digests(tensors)}
    assert broadcast_readers.tags(tensors) == {2}
    good = {"generation": 12, "digests": published[12]["digests"], "tags": [2]}
    first = next(iter(tensors.values()))
    broadcast_readers.fill({"first": first}, 1)  # one tensor of generation 11 among those of 12
    tags = sorted(broadcast_readers.tags(tensors))
    mix = {"generation": 12, "digests": broadcast_readers.digests(tensors), "tags": tags}
    stale = {**good, "generation": 11}  # the bytes of 12 reported as 11
    assert mix["tags"] == [1, 2]
    assert broadcast.mixed_reads(published, [good, mix, stale]) == [mix, stale]


def test_a_reader_with_wrong_bytes_fails_the_bench(tmp_path: Path) -> None:
    harness = broadcast_harness.Harness(
        broadcast_harness.Setup(), "tcp://unused", tmp_path, [], {"a": "00", "b": "11"}, 8
    )
    with pytest.raises(broadcast_harness.WrongBytes, match=r"star reader 1 .* 1 tensors: b"):
        harness._check("star", [{"digests": {"a": "00", "b": "11"}}, {"digests": {"a": "00", "b": "12"}}])
