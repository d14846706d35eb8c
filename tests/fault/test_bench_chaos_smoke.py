"""`tensorwire bench chaos`, briefly: real replicated servers and workers, killed and restarted."""

from __future__ import annotations

from tensorwire.bench import chaos


def test_a_short_chaos_run_loses_and_doubles_nothing() -> None:
    result = chaos.run(steps=1200, interval=2.5, seed=1)
    assert result["faults_injected"] >= 1
    assert result["lost_updates"] == 0 and result["duplicate_updates"] == 0
    assert result["loss"] > 0
