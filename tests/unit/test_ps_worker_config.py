"""``WorkerConfig.resolve``: a worker's arguments completed from the environment once, and what
cannot work together refused before anything connects; and the deprecated ``ps.allreduce``."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from tensorwire.ps import ExchangeClient, Mode
from tensorwire.ps.worker.config import WorkerConfig


@pytest.fixture
def params() -> dict[str, torch.nn.Parameter]:
    return dict(torch.nn.Linear(4, 2).named_parameters())


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "TENSORWIRE_JOB", "TENSORWIRE_JOB_TOKEN", "TENSORWIRE_SERVERS"):
        monkeypatch.delenv(name, raising=False)


def test_resolved_from_the_environment(
    params: dict[str, torch.nn.Parameter], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("TENSORWIRE_JOB", "mnist")
    monkeypatch.setenv("TENSORWIRE_JOB_TOKEN", "s3cret")
    config = WorkerConfig.resolve(params, "tcp://a:1,tcp://b:2", "ssp:2", push_codec="int8")
    assert (config.rank, config.world_size, config.job) == (1, 3, "mnist")
    assert config.servers == ("tcp://a:1", "tcp://b:2")
    assert config.mode == Mode.parse("ssp:2")
    assert config.push_codec is not None and config.error_feedback  # lossy: feedback on by default
    assert config.job_token == b"s3cret"
    assert "s3cret" not in repr(config)  # a secret: never shown
    assert not config.relay
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rank = 0  # type: ignore[misc]


def test_job_derived_from_the_model(params: dict[str, torch.nn.Parameter]) -> None:
    one = WorkerConfig.resolve(params, "tcp://a:1")
    other = WorkerConfig.resolve(dict(torch.nn.Linear(5, 2).named_parameters()), "tcp://a:1")
    assert one.job == WorkerConfig.resolve(params, "tcp://a:1").job
    assert one.job != other.job


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2, "world_size": 2}, "not in a world"),
        ({"pull_codec": "topk:0.1"}, "drops elements"),
        ({"error_feedback": True}, "needs a push_codec"),
        ({"pull": "gossip"}, "pull must be"),
        ({"pull": "relay", "pull_codec": "int8"}, "no pull_codec"),
        ({"pull": "relay", "servers": "shm://127.0.0.1:1"}, "tcp:// or tls://"),
        ({"job_token": "x" * 10_000}, "job token"),
    ],
)
def test_refused_before_connecting(
    params: dict[str, torch.nn.Parameter], kwargs: dict[str, object], message: str
) -> None:
    kwargs = {"servers": "tcp://a:1", **kwargs}
    with pytest.raises(ValueError, match=message):
        WorkerConfig.resolve(params, **kwargs)  # type: ignore[arg-type]


def test_allreduce_is_a_deprecated_name() -> None:
    allreduce = importlib.import_module("tensorwire.ps.allreduce")
    with pytest.warns(DeprecationWarning, match="tensorwire.ps.ExchangeClient"):
        assert allreduce.ExchangeClient is ExchangeClient
