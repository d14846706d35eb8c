"""What a relay pull of the parameter server takes from others: the generations it reads are the
server's own (no client publishes under ``_ps``), and a manifest that is not exactly the worker's
shards is refused before a byte lands in the parameters."""

from __future__ import annotations

import pytest
import torch

import tensorwire
from tensorwire.errors import InvalidName, ProtocolError
from tensorwire.ps.job import relay_name
from tensorwire.ps.placement import ParamSpec, plan
from tensorwire.ps.worker.relay_reader import RelayPulls
from tensorwire.server import ServerThread
from tensorwire.transport import TransportOptions
from tensorwire.types import TensorMeta
from tensorwire.wire import relay as wr


@pytest.mark.parametrize("prefix", ["_ps", "_ps/job", "_ps/job/deeper"])
def test_no_client_publishes_under_the_parameter_servers_prefix(prefix: str) -> None:
    with ServerThread() as server, tensorwire.connect(server.url) as client:
        with pytest.raises(InvalidName, match="_ps"):
            client.publish(prefix, {"w": torch.ones(4)})
        client.publish("ps_lookalike", {"w": torch.ones(4)})  # only the prefix itself is reserved


def manifest(*metas: TensorMeta) -> wr.Manifest:
    chunks = sum(max(1, -(-m.nbytes // 64)) for m in metas)
    return wr.Manifest(7, 64, metas, (0,) * chunks)


def meta(name: str, dtype: torch.dtype, numel: int) -> TensorMeta:
    return TensorMeta(name, dtype, (numel,), numel * dtype.itemsize, 7)


def pulls_of(model: torch.nn.Module) -> tuple[RelayPulls, list[object]]:
    params = dict(model.named_parameters())
    shards = plan(ParamSpec.of(model), 1).on_server(0)
    return RelayPulls("job", TransportOptions(1.0, 1.0), params, exact=True), list(shards)


@pytest.mark.parametrize(
    "bad",
    [
        "extra",  # a tensor the worker does not hold
        "missing",  # one of its shards left out
        "twice",  # one shard named twice (in place of another)
        "size",  # a shard of another size
        "dtype",  # a shard of another dtype
    ],
)
def test_a_manifest_that_is_not_the_workers_shards_is_refused_before_anything_lands(bad: str) -> None:
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    pulls, shards = pulls_of(model)
    right = [meta(relay_name("job", s.key), torch.float32, s.numel) for s in shards]  # type: ignore[attr-defined]
    metas = {
        "extra": [*right, meta(relay_name("job", "other#0:4"), torch.float32, 4)],
        "missing": right[:1],
        "twice": [right[0], right[0]],
        "size": [right[0], meta(right[1].name, torch.float32, right[1].shape[0] + 1)],
        "dtype": [right[0], meta(right[1].name, torch.float64, right[1].shape[0])],
    }[bad]
    with pytest.raises(ProtocolError, match="relay"):
        pulls._bind(shards, manifest(*metas))  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert len(pulls._bind(shards, manifest(*right))) == len(right)  # type: ignore[arg-type]
