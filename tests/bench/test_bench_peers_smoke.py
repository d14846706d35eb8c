"""The peers benchmark runs end to end on tiny sizes against gloo and the Mooncake engine (TCP
mode) and reports every figure; a peer that cannot run gives None and says why. Ray's own start
takes ~8 s here: one test runs the Ray peer on tiny sizes (its RDT keys: tensorwire's transport,
Ray's gloo and object store, actor to actor); its real run is ``bench peers`` itself."""

from __future__ import annotations

import json

import pytest

from tensorwire.bench import peers, peers_ray
from tensorwire.testing import rdma as kit

TINY = ["--size", "1MiB", "--iters", "1", "--small-iters", "20", "--many", "50"]


def _positive(result: dict[str, object], keys: tuple[str, ...]) -> None:
    for key in keys:
        value = result[key]
        # A figure the benchmark could not take is None, and its note says why: show it.
        notes = {k: v for k, v in result.items() if k.endswith("_note")}
        assert isinstance(value, int | float) and not isinstance(value, bool) and value > 0, (key, notes)


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


def test_peers_bench_ray_reports_the_rdt_figures(capsys: pytest.CaptureFixture[str]) -> None:
    tiny = [*TINY, "--ray-size", "1MiB", "--rdt-sizes", "1MiB,2MiB", "--small-iters", "5"]
    result = peers.main(["--peers", "ray", *tiny, "--json"])

    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    _positive(result, ("ray_rdt_tw_gbps", "ray_rdt_object_store_gbps"))
    if result["ray_rdt_gloo_gbps"] is None:  # Ray's gloo RDT could not run here: it says why
        assert "gloo" in str(result["ray_rdt_note"]) and result["ray_rdt_tw_vs_gloo"] is None
    else:
        _positive(result, ("ray_rdt_gloo_gbps", "ray_rdt_tw_vs_gloo"))
    assert result["ray_rdt_tw_gbps"] == result["ray_rdt_tw_gbps_2mib"]  # the largest size's
    _positive(result, tuple(f"ray_rdt_{w}_gbps_1mib" for w in ("tw", "object_store")))
    assert set(peers_ray.RDT_KEYS) <= set(peers_ray.KEYS)  # a failed Ray run nulls them too
    assert any(row[0] == "Ray RDT tensorwire" for row in peers_ray.rows(result, peers._fmt))
