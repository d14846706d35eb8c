"""`tensorwire bench gpu` (`make gpu-check`): it skips cleanly without a CUDA device, and its
measurements run end to end on the CPU (the same code, the staging through a host copier)."""

from __future__ import annotations

import json

import pytest
import torch

from tensorwire.bench import gpu
from tensorwire.types import MiB


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: make gpu-check runs it")
def test_without_a_device_it_says_so_and_exits_0_or_2_when_required(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert gpu.main(["--json"])["cuda"] is False
    out, err = capsys.readouterr()
    assert json.loads(out)["cuda"] is False and "gpu check skipped" in err
    with pytest.raises(SystemExit) as exit_:
        gpu.main(["--require"])
    assert exit_.value.code == 2


def test_its_measurements_run_on_the_cpu() -> None:
    result = gpu.measure(torch.device("cpu"), steps=3, batch=4, size=1 * MiB, repeats=1)
    assert result["ps_matches_single_gpu"] is True
    assert (
        isinstance(result["ps_vs_single_gpu_max_diff"], float) and result["ps_vs_single_gpu_max_diff"] <= 1e-5
    )
    for key in (
        "torch_d2h_gbps",
        "staging_d2h_gbps",
        "torch_h2d_gbps",
        "staging_h2d_gbps",
        "exchange_cpu_gbps",
    ):
        value = result[key]
        assert isinstance(value, float) and value > 0, key
    assert result["staging_bytes"] == 1 * MiB and result["staging_pinned"] is False
