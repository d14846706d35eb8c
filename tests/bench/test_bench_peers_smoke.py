"""The peers benchmark runs end to end on tiny sizes against gloo and the Mooncake engine (TCP
mode) and reports every figure; a peer that cannot run gives None and says why. Ray's own start
takes ~8 s here, so its real run is ``bench peers`` itself (the README's table), not this test."""

from __future__ import annotations

import json

import pytest

from tensorwire.bench import peers, peers_ray
from tensorwire.testing import rdma as kit

TINY = ["--size", "1MiB", "--iters", "1", "--small-iters", "20", "--many", "50"]


def _positive(result: dict[str, object], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = result[key]
        assert isinstance(value, int | float) and not isinstance(value, bool) and value > 0, key


def test_peers_bench_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    result = peers.main(["--peers", "gloo,mooncake", *TINY, "--json"])

    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == result
    _positive(result, peers.TCP_KEYS + peers.GLOO_KEYS)
    if kit.unavailable() is None:
        _positive(result, peers.MOONCAKE_KEYS)
        assert result["mooncake_note"] == "engine protocol tcp (no RDMA NIC measured)"
    else:  # no wheel or no libibverbs1: nulls and the reason, never a crash
        assert all(result[key] is None for key in peers.MOONCAKE_KEYS)
        assert "Mooncake" in str(result["mooncake_note"])
    assert "ray_put_gbps" not in result  # not asked for
    assert peers.format_table(result)


def test_a_peer_that_cannot_run_gives_nulls_and_why() -> None:
    def broken() -> peers.Result:
        raise OSError("no such device")

    result = peers._guarded(peers_ray.KEYS, "ray", None, broken)
    assert all(result[key] is None for key in peers_ray.KEYS)
    assert result["ray_note"] == "failed: OSError: no such device"
    missing = peers._guarded(peers_ray.KEYS, "ray", "Ray is not installed", broken)
    assert missing["ray_note"] == "Ray is not installed"
    assert peers_ray.rows(missing, format) == [("Ray", "n/a", "Ray is not installed")]
