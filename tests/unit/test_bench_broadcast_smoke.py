"""`tensorwire bench broadcast` end to end, tiny, on loopback (it runs everywhere): a real origin
server, the published state_dict, reader processes checked bit-exact. In network namespaces:
tests/fault/test_broadcast_netns.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorwire.bench import broadcast, broadcast_readers

TINY = ["--readers", "2", "--size", "1MiB", "--tensors", "12", "--timeout", "60"]


def test_layout_is_transformer_like_and_within_the_size() -> None:
    lay = broadcast_readers.layout(256 << 20, 75)
    assert len(lay) == 75 and {dtype for _, dtype, _ in lay} == {torch.bfloat16, torch.float32}
    assert 0.95 * (256 << 20) < broadcast_readers.model_bytes(lay) <= 256 << 20
    assert broadcast_readers.model_bytes(broadcast_readers.layout(1 << 20, 12)) <= 1 << 20


def test_bench_broadcast_on_loopback_measures_single_star_and_delta() -> None:
    result = broadcast.main(["--no-netns", *TINY])
    assert result["network"].startswith("loopback") and "skipped" not in result
    assert result["readers"] == 2 and result["tensors"] == 12 and result["model_bytes"] <= 1 << 20
    assert result["single_s"] > 0 and result["star_s"] > 0 and len(result["star_reader_s"]) == 2
    assert result["star_vs_single"] == result["star_s"] / result["single_s"]
    # Nothing for what is not built, nor for what loopback cannot count: reasons instead.
    # delta: the next generation (1% changed) read against the one before, checked bit-exact
    assert result["delta_s"] > 0 and result["delta_bytes_source"].startswith("client")
    assert 0 < result["delta_bytes"] == result["delta_bytes_ratio"] * result["model_bytes"]
    assert result["delta_bytes_ratio"] <= 0.05
    assert result["delta_chunks"]["full_chunks"] == result["delta_chunks"]["refetched"] == 0
    assert {"fanout", "mixed", "killed", "origin_egress", "bound_s"} <= set(result["not_measured"])
    assert "delta" not in result["not_measured"]
    assert not {"fanout_s", "origin_egress_ratio", "bound_s", "rate_gbit"} & set(result)


def test_a_reader_with_wrong_bytes_fails_the_bench(tmp_path: Path) -> None:
    harness = broadcast.Harness(broadcast.Setup(), "tcp://unused", tmp_path, [], {"a": "00", "b": "11"}, 8)
    with pytest.raises(broadcast.WrongBytes, match=r"star reader 1 .* 1 tensors: b"):
        harness._check("star", [{"digests": {"a": "00", "b": "11"}}, {"digests": {"a": "00", "b": "12"}}])
