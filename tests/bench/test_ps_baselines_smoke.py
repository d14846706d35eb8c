"""The PS baselines run end to end on a tiny MLP, and their child processes never outlive a call."""

from __future__ import annotations

import json
import math
import signal

import psutil
import pytest
import torch

from tensorwire.bench import ps_baselines
from tensorwire.bench.ps_baselines import Workload, main, make_model, param_count, synthetic_batch

TINY = ["--sizes", "32,64,10", "--batch", "16", "--steps", "5", "--warmup", "1", "--timeout", "60"]


def _live_children() -> list[psutil.Process]:
    # multiprocessing's resource tracker is started by the first spawn and lives on by design. A
    # zombie has ended (it waits for its parent to read its status: another test's, maybe) and one
    # that ends meanwhile is gone: neither is alive.
    live = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline()):
                live.append(child)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return live


def test_both_baselines_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    result = main(TINY)

    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == result
    assert result["params"] == 32 * 64 + 64 + 64 * 10 + 10
    for key in ("rpc_ps_samples_per_s", "ddp_samples_per_s"):
        value = result[key]
        assert isinstance(value, float), key
        assert math.isfinite(value) and value > 0, key
    assert _live_children() == []


def test_default_workload_is_about_ten_million_parameters() -> None:
    w = Workload()
    model = make_model(w)

    assert 9_000_000 <= param_count(w) <= 11_000_000
    assert sum(p.numel() for p in model.parameters()) == param_count(w)
    kinds = [type(layer) for layer in model.children()]
    assert kinds == [torch.nn.Linear, torch.nn.ReLU] * 3 + [torch.nn.Linear]


def test_model_depends_on_the_seed_only() -> None:
    w = Workload(sizes=(8, 4, 3))
    first, again = make_model(w), make_model(w)
    other = make_model(Workload(sizes=(8, 4, 3), seed=1))

    for a, b in zip(first.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(next(first.parameters()), next(other.parameters()))


def test_synthetic_batch_is_deterministic_per_rank_and_step() -> None:
    w = Workload(sizes=(8, 4, 3), batch=5)
    x, y = synthetic_batch(w, rank=1, step=2)

    assert x.shape == (5, 8) and x.dtype == torch.float32
    assert y.shape == (5,) and y.dtype == torch.int64
    assert int(y.min()) >= 0 and int(y.max()) < 3
    x_again, y_again = synthetic_batch(w, rank=1, step=2)
    assert torch.equal(x, x_again) and torch.equal(y, y_again)
    assert not torch.equal(x, synthetic_batch(w, rank=0, step=2)[0])
    assert not torch.equal(x, synthetic_batch(w, rank=1, step=3)[0])


@pytest.mark.parametrize(
    "bad", [{"sizes": (8,)}, {"sizes": (8, 0)}, {"batch": 0}, {"warmup": 0}, {"workers": 0}]
)
def test_workload_rejects_unusable_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Workload(**bad)  # type: ignore[arg-type]


def test_child_error_is_raised_naming_the_child() -> None:
    # _server_rref fails in any process that is not the parameter server.
    jobs: list[ps_baselines.Job] = [("the odd child", ps_baselines._server_rref, ())]

    with pytest.raises(RuntimeError, match=r"the odd child failed:(.|\n)*holds no parameter server"):
        ps_baselines.run_children("odd children", jobs, timeout=60.0)
    assert _live_children() == []


def test_timeout_names_what_it_waited_for_and_ends_the_children() -> None:
    jobs: list[ps_baselines.Job] = [("pauser", signal.pause, ())]  # waits for a signal forever

    with pytest.raises(TimeoutError, match=r"waited 1s for the pausers to finish \(still running: pauser\)"):
        ps_baselines.run_children("pausers", jobs, timeout=1.0)
    assert _live_children() == []


def test_interrupt_ends_the_children(monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*_: object) -> dict[str, object]:
        raise KeyboardInterrupt

    monkeypatch.setattr(ps_baselines, "_collect", interrupted)
    jobs: list[ps_baselines.Job] = [("pauser", signal.pause, ())]

    with pytest.raises(KeyboardInterrupt):
        ps_baselines.run_children("pausers", jobs, timeout=60.0)
    assert _live_children() == []


def test_server_steps_once_per_round_with_the_mean_gradient() -> None:
    w = Workload(sizes=(3, 2), workers=2, lr=0.5)
    server = ps_baselines.BatchUpdateParameterServer(w)
    before = [p.detach().clone() for p in server.params]
    ones = [torch.ones_like(p) for p in before]
    threes = [torch.full_like(p, 3.0) for p in before]

    first = server.add_gradients(ones)
    assert not first.done()  # waits for the second trainer
    second = server.add_gradients(threes)

    assert second is first and first.done()
    for new, old in zip(first.value(), before, strict=True):
        assert torch.allclose(new, old - 0.5 * 2.0)  # lr * mean(1, 3)
    assert not server.add_gradients(ones).done()  # a new round
