"""`tensorwire bench engines` end to end at 8 MiB: real vLLM CPU engines (two, for the origin's
egress), a real origin server. Figures are checked for shape, never for speed."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm", reason="needs vLLM: `make test-engines` runs tests/engines in .venv-engines")

from tensorwire.bench import engines

RATIOS = ("tw_vs_rpc", "tw_vs_bound", "delta_update_bytes_ratio", "origin_egress_ratio")
SECONDS = (
    "tw_update_s",
    "tw_first_update_s",
    "rpc_update_s",
    "bound_s",
    "load_s",
    "delta_update_s",
    "tw_pause_s",
)


@pytest.mark.slow
def test_bench_engines_prints_every_figure_as_one_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    result = engines.main(["--mib", "8", "--rounds", "2", "--engines", "2", "--json"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == result
    assert result["device"] == "cpu" and result["engines"] == 2
    assert 7 <= result["model_mib"] <= 9, result["model_mib"]
    for key in (*RATIOS, *SECONDS):
        value = result[key]
        assert isinstance(value, int | float) and math.isfinite(value) and value > 0, (key, value)
    assert result["tw_vs_rpc"] == result["tw_update_s"] / result["rpc_update_s"]
    assert result["tw_vs_bound"] == result["tw_update_s"] / result["bound_s"]
    # bytes the origin's counters saw: a 1% change is far less than the model, and two engines
    # reading one new generation through the relay cost the origin about one model
    assert result["delta_update_bytes_ratio"] < 0.5, result["delta_update_bytes_ratio"]
    assert result["origin_egress_ratio"] >= 1.0, result["origin_egress_ratio"]
