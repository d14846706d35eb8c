"""``tensorwire.sharded.checkpoint``: the snapshot, the one-in-flight rule, errors through the
future, and a world of one through a real server (no torch.distributed)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

import tensorwire
from tensorwire import sharded
from tensorwire.errors import ConnectError, TransferTimeout
from tensorwire.server import ServerThread
from tensorwire.sharded import state as sharded_state
from tensorwire.sharded.checkpoint import (
    AsyncSaver,
    Snapshot,
    async_save,
    load_training_state,
    training_state,
)
from tensorwire.types import Generation

WAIT = 30.0  # a deadline for things that happen at once


class FakePut:
    """``put_state_dict`` that records what it uploads and holds each upload until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.uploads: list[dict[str, torch.Tensor]] = []
        self.kwargs: list[dict[str, Any]] = []
        self.fail: Exception | None = None

    def __call__(
        self, client: object, prefix: str, state: Mapping[str, torch.Tensor], **kw: Any
    ) -> Generation:
        self.started.set()
        assert self.release.wait(WAIT)
        self.kwargs.append(kw)
        if self.fail is not None:
            raise self.fail
        self.uploads.append({k: v.clone() for k, v in state.items()})
        return Generation(prefix, len(self.uploads), b"\0" * 16, tuple(sorted(state)), 0)


@pytest.fixture
def fake_put(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakePut]:
    fake = FakePut()
    monkeypatch.setattr(sharded_state, "put_state_dict", fake)
    yield fake
    fake.release.set()  # never leave a saver's thread waiting


def test_save_returns_before_the_upload_and_uploads_the_state_as_it_was(fake_put: FakePut) -> None:
    weight = torch.arange(6.0).reshape(2, 3)
    client: Any = object()  # the fake put never uses it
    with AsyncSaver() as saver:
        future = saver.save(client, "ckpt", {"w": weight})
        assert fake_put.started.wait(WAIT) and not future.done()  # the upload waits; save returned
        weight.add_(100)  # training goes on, changing the tensor in place
        fake_put.release.set()
        generation = future.result(WAIT)
    assert generation.number == 1 and generation.names == ("w",)
    assert torch.equal(fake_put.uploads[0]["w"], torch.arange(6.0).reshape(2, 3))
    assert fake_put.kwargs[0]["group"] is None  # no torch.distributed: a world of one, no group


def test_buffers_are_reused_and_made_again_when_a_shape_changes() -> None:
    snapshot = Snapshot()
    first = snapshot.take({"a": torch.ones(4), "b": torch.zeros(2, 2)})
    again = snapshot.take({"a": torch.full((4,), 2.0), "b": torch.ones(2, 2)})
    assert again["a"].data_ptr() == first["a"].data_ptr() and torch.equal(again["a"], torch.full((4,), 2.0))
    grown = snapshot.take({"a": torch.ones(8), "b": torch.ones(2, 2)})
    assert grown["a"].shape == (8,) and grown["b"].data_ptr() == first["b"].data_ptr()
    assert snapshot.nbytes == (8 + 4) * 4


def test_a_second_save_waits_for_the_first(fake_put: FakePut) -> None:
    state = {"w": torch.ones(3)}
    client: Any = object()
    with AsyncSaver(timeout=0.2) as saver:
        first = saver.save(client, "ckpt", state)
        # still uploading: the second save waits for it, then gives up
        with pytest.raises(TransferTimeout, match="previous save"):
            saver.save(client, "ckpt", state)
        fake_put.release.set()
        assert first.result(WAIT).number == 1
        assert saver.save(client, "ckpt", state).result(WAIT).number == 2
    assert saver.saves == 2


def test_an_upload_error_surfaces_through_the_future_and_the_next_save_goes_on(fake_put: FakePut) -> None:
    fake_put.release.set()
    fake_put.fail = ConnectError("server gone")
    client: Any = object()
    with AsyncSaver() as saver:
        failed = saver.save(client, "ckpt", {"w": torch.ones(2)})
        assert isinstance(failed.exception(WAIT), ConnectError)
        fake_put.fail = None
        assert saver.save(client, "ckpt", {"w": torch.ones(2)}).result(WAIT).number == 1
    with pytest.raises(RuntimeError, match="closed"):
        saver.save(client, "ckpt", {"w": torch.ones(2)})


def test_async_save_through_a_url_round_trips_in_a_world_of_one() -> None:
    state = {"layer/weight": torch.randn(4, 6), "step": torch.tensor(7.0)}
    with ServerThread(["tcp://127.0.0.1:0"]) as server, AsyncSaver() as saver:
        future = async_save(server.url, "ckpt", state, saver=saver)  # the saver opens its own client
        generation = future.result(WAIT)
        into = {name: torch.zeros_like(t) for name, t in state.items()}
        with tensorwire.connect(server.url) as client:
            read = sharded.load_state_dict(client, "ckpt", into)
    assert read.number == generation.number
    assert all(torch.equal(into[name], state[name]) for name in state)


def test_training_state_names_and_restores_a_model_and_its_optimizer() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    saved = {name: t.detach().clone() for name, t in training_state(model, optimizer).items()}
    assert set(saved) == {"model/weight", "model/bias", "optim/weight/step", "optim/weight/exp_avg",
                          "optim/weight/exp_avg_sq", "optim/bias/step", "optim/bias/exp_avg",
                          "optim/bias/exp_avg_sq"}  # fmt: skip

    torch.manual_seed(1)
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    state = training_state(fresh, fresh_optimizer)  # what a resuming job loads into
    for name, tensor in state.items():
        tensor.detach().copy_(saved[name])
    load_training_state(fresh, fresh_optimizer, state)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    restored, original = fresh_optimizer.state[fresh.weight], optimizer.state[model.weight]
    assert torch.equal(restored["exp_avg"], original["exp_avg"])
    assert float(restored["step"]) == 1.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_a_cuda_shard_is_copied_into_a_pinned_buffer_on_the_current_stream() -> None:
    snapshot = Snapshot()
    weight = torch.randn(1024, 1024, device="cuda")
    expected = weight.cpu()
    copies = snapshot.take({"w": weight})
    weight.add_(1)  # queued after the copy on the same stream: the snapshot keeps the old values
    snapshot.wait_copied()
    assert copies["w"].is_pinned() and copies["w"].device.type == "cpu"
    assert torch.equal(copies["w"], expected)


def test_the_names_before_issue_33_still_work_and_warn() -> None:
    state = {"layer/weight": torch.randn(4, 6)}
    into = {name: torch.zeros_like(t) for name, t in state.items()}
    with ServerThread(["tcp://127.0.0.1:0"]) as server, AsyncSaver() as saver:
        with pytest.warns(
            DeprecationWarning, match=r"save_async is deprecated; use tensorwire\.sharded\.async_save"
        ):
            generation = sharded.save_async(server.url, "old", state, saver=saver).result(WAIT)
        with (
            tensorwire.connect(server.url) as client,
            pytest.warns(
                DeprecationWarning,
                match=r"get_state_dict is deprecated; use tensorwire\.sharded\.load_state_dict",
            ),
        ):
            assert sharded.get_state_dict(client, "old", into) == generation
    assert torch.equal(into["layer/weight"], state["layer/weight"])
