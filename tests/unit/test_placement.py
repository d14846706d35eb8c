from __future__ import annotations

import json
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorwire.ps import ParamSpec, Placement, Shard, plan
from tensorwire.types import MiB

F32 = torch.float32


def mlp() -> torch.nn.Sequential:
    # Built on the meta device: placement reads only shapes and dtypes, so no memory is touched.
    with torch.device("meta"):
        return torch.nn.Sequential(
            torch.nn.Linear(784, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024),
            torch.nn.ReLU(),
            torch.nn.Linear(1024, 10),
        )


def embedding_model() -> torch.nn.Sequential:
    """One huge embedding (~98 MiB) and many small tensors (1 MiB weights, 2 KiB norms)."""
    with torch.device("meta"):
        layers: list[torch.nn.Module] = [torch.nn.Embedding(50_000, 512)]
        for _ in range(12):
            layers += [torch.nn.Linear(512, 512), torch.nn.LayerNorm(512)]
        return torch.nn.Sequential(*layers)


def assert_partition(placement: Placement) -> None:
    """Every element of every parameter is in exactly one shard; shards are contiguous and ordered."""
    assert list(placement.shards) == sorted(placement.shards, key=lambda s: (s.param, s.start))
    for spec in placement.params:
        shards = placement.shards_of(spec.name)
        assert shards, spec.name
        if spec.numel == 0:
            assert [(s.start, s.stop) for s in shards] == [(0, 0)]
            continue
        # Starting at 0, each shard starting where the last stopped and the last stopping at numel:
        # together with no empty shard, that is "every element exactly once".
        assert [s.start for s in shards] == [0] + [s.stop for s in shards[:-1]]
        assert shards[-1].stop == spec.numel
        assert all(s.numel > 0 and 0 <= s.server < placement.servers for s in shards)
    assert len(placement.shards) == sum(len(placement.shards_of(p.name)) for p in placement.params)
    assert sum(placement.load()) == sum(p.nbytes for p in placement.params)


# -- ParamSpec and Shard ----------------------------------------------------------------------------


def test_spec_of_module_keeps_module_order_and_trainable_params() -> None:
    model = mlp()
    model[2].bias.requires_grad_(False)
    specs = ParamSpec.of(model)
    assert [s.name for s in specs] == ["0.weight", "0.bias", "2.weight", "4.weight", "4.bias"]
    assert specs[0] == ParamSpec("0.weight", (1024, 784), F32)
    assert (specs[0].numel, specs[0].nbytes) == (1024 * 784, 1024 * 784 * 4)
    assert type(specs[0].shape) is tuple


def test_spec_of_module_lists_a_tied_parameter_once() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    assert [s.name for s in ParamSpec.of(model)] == ["0.weight"]


def test_spec_from_tensors() -> None:
    tensors = {"b": torch.zeros(3, dtype=torch.bfloat16), "a": torch.zeros(2, 5, dtype=torch.int64)}
    assert ParamSpec.from_tensors(tensors) == [
        ParamSpec("b", (3,), torch.bfloat16),
        ParamSpec("a", (2, 5), torch.int64),
    ]
    assert ParamSpec("s", (), F32).numel == 1  # a scalar has one element
    with pytest.raises(ValueError, match="negative"):
        ParamSpec("x", (2, -1), F32)


def test_shard_key_and_numel() -> None:
    shard = Shard("fc.weight", 1, 4096, 8192)
    assert shard.numel == 4096
    assert shard.key == "fc.weight#4096:8192"
    assert Shard("odd#name", 0, 0, 5).key.rpartition("#") == ("odd#name", "#", "0:5")


# -- plan: rules ------------------------------------------------------------------------------------


def test_plan_is_deterministic_and_independent_of_input_order() -> None:
    specs = ParamSpec.of(embedding_model())
    first = plan(specs, 3)
    assert plan(specs, 3) == first
    assert plan(list(reversed(specs)), 3) == first
    assert plan(sorted(specs, key=lambda s: s.nbytes), 3).to_json() == first.to_json()
    assert [p.name for p in first.params] == sorted(s.name for s in specs)


def test_one_server_holds_every_parameter_whole() -> None:
    specs = ParamSpec.of(embedding_model())
    placement = plan(specs, 1, split_bytes=0)  # even "split everything" cannot split on one server
    assert placement.shards == tuple(
        sorted((Shard(s.name, 0, 0, s.numel) for s in specs), key=lambda s: s.param)
    )
    assert placement.load() == [sum(s.nbytes for s in specs)]
    assert placement.imbalance() == 1.0


def test_small_tensors_pack_largest_first_onto_least_loaded_server() -> None:
    # Sizes 5, 4, 3, 3, 2 (x4 bytes); equal sizes go by name and equal loads by lowest server.
    sizes = {"e": 2, "d": 3, "c": 3, "b": 4, "a": 5}
    placement = plan([ParamSpec(n, (k,), F32) for n, k in sizes.items()], 2, split_bytes=4 * MiB)
    assert {s.param: s.server for s in placement.shards} == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1}
    assert placement.load() == [32, 36]


def test_a_tensor_of_exactly_split_bytes_stays_whole() -> None:
    placement = plan([ParamSpec("w", (1024, 1024), F32)], 4, split_bytes=4 * MiB)
    assert len(placement.shards) == 1
    assert len(plan([ParamSpec("w", (1024, 1024), F32)], 4, split_bytes=4 * MiB - 1).shards) == 4


def test_large_tensor_is_split_contiguously_across_all_servers() -> None:
    placement = plan([ParamSpec("emb", (1000, 7), F32)], 3, split_bytes=1024)
    shards = placement.shards_of("emb")
    assert [s.server for s in shards] == [0, 1, 2]
    assert (shards[0].start, shards[-1].stop) == (0, 7000)
    assert all(a.stop == b.start for a, b in pairwise(shards))
    assert max(s.numel for s in shards) - min(s.numel for s in shards) <= 1


def test_tensor_with_fewer_elements_than_servers_is_cut_per_element() -> None:
    placement = plan([ParamSpec("t", (2,), torch.float64)], 4, split_bytes=0)
    shards = placement.shards_of("t")
    assert [s.numel for s in shards] == [1, 1]
    assert len({s.server for s in shards}) == 2
    assert_partition(placement)


def test_empty_model_and_empty_parameter() -> None:
    empty = plan([], 3)
    assert (empty.shards, empty.load(), empty.imbalance()) == ((), [0, 0, 0], 1.0)
    assert "server 2" in empty.describe()
    # A parameter with no elements still gets a home: one [0, 0) shard, the only empty shard.
    placement = plan([ParamSpec("none", (0, 5), F32), ParamSpec("w", (8,), F32)], 2, split_bytes=0)
    assert placement.shards_of("none") == (Shard("none", 0, 0, 0),)
    assert_partition(placement)


@pytest.mark.parametrize("servers", [0, -1])
def test_plan_refuses_no_servers(servers: int) -> None:
    with pytest.raises(ValueError, match="servers"):
        plan([ParamSpec("w", (4,), F32)], servers)


def test_plan_refuses_duplicate_names_and_negative_split() -> None:
    with pytest.raises(ValueError, match="'w' appears twice"):
        plan([ParamSpec("w", (4,), F32), ParamSpec("w", (2,), torch.int8)], 2)
    with pytest.raises(ValueError, match="split_bytes"):
        plan([], 2, split_bytes=-1)


# -- balance ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("servers", [2, 3, 4])
def test_mlp_is_balanced(servers: int) -> None:
    # At the default 4 MiB no tensor of this 7 MiB model is over the threshold (the 1024x1024
    # weight is exactly 4 MiB), so it cannot balance; a 1 MiB threshold splits both big weights.
    placement = plan(ParamSpec.of(mlp()), servers, split_bytes=1 * MiB)
    assert placement.imbalance() <= 1.05
    assert_partition(placement)


@pytest.mark.parametrize("servers", [2, 3, 4])
def test_embedding_plus_small_tensors_is_balanced(servers: int) -> None:
    placement = plan(ParamSpec.of(embedding_model()), servers)
    assert placement.imbalance() <= 1.05
    assert len(placement.shards_of("0.weight")) == servers  # the embedding is spread over all
    assert all(len(placement.shards_of(p.name)) == 1 for p in placement.params if p.name != "0.weight")


def test_large_tensors_fill_the_gaps_left_by_small_ones() -> None:
    # Small 3 and 1 MiB, large 6 MiB: splitting the large one evenly first would end at 6 and
    # 4 MiB (1.2); filling after packing ends at 5 and 5.
    specs = [ParamSpec("s3", (3 * MiB,), torch.uint8), ParamSpec("s1", (MiB,), torch.uint8)]
    specs.append(ParamSpec("big", (6 * MiB,), torch.uint8))
    placement = plan(specs, 2, split_bytes=4 * MiB)
    assert placement.load() == [5 * MiB, 5 * MiB]
    assert [s.numel for s in placement.shards_of("big")] == [2 * MiB, 4 * MiB]


def test_a_server_above_the_level_gets_no_piece_of_large_tensors() -> None:
    # "small" alone is over a fair share; "big" can only even out the two other servers.
    specs = [ParamSpec("small", (100,), torch.uint8), ParamSpec("big", (150,), torch.uint8)]
    placement = plan(specs, 3, split_bytes=100)
    assert placement.shards_of("big") == (Shard("big", 1, 0, 75), Shard("big", 2, 75, 150))
    assert placement.load() == [100, 75, 75]


# -- properties -------------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int64, torch.bool]
SPECS = st.lists(
    st.builds(
        ParamSpec,
        name=st.from_regex(r"[a-z][a-z0-9._#]{0,6}", fullmatch=True),
        shape=st.lists(st.integers(0, 12), max_size=3).map(tuple),
        dtype=st.sampled_from(DTYPES),
    ),
    max_size=12,
    unique_by=lambda s: s.name,
)


@settings(max_examples=200, deadline=None)
@given(specs=SPECS, servers=st.integers(1, 8), split_bytes=st.integers(0, 4000))
def test_every_element_is_in_exactly_one_shard(
    specs: list[ParamSpec], servers: int, split_bytes: int
) -> None:
    placement = plan(specs, servers, split_bytes)
    assert_partition(placement)
    for spec in placement.params:
        shards = placement.shards_of(spec.name)
        if spec.nbytes <= split_bytes:
            assert len(shards) == 1
        assert len({s.server for s in shards}) == len(shards)  # one piece per server at most
    assert Placement.from_json(placement.to_json()) == placement
    assert plan(list(reversed(specs)), servers, split_bytes) == placement


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=10), servers=st.integers(2, 6))
def test_split_tensors_balance_to_within_rounding(sizes: list[int], servers: int) -> None:
    specs = [ParamSpec(f"p{i}", (n,), F32) for i, n in enumerate(sizes)]
    loads = plan(specs, servers, split_bytes=0).load()
    # Each rounded boundary moves a piece by under one element, so two servers differ by less
    # than two elements per tensor.
    assert max(loads) - min(loads) < 2 * 4 * len(specs)


# -- JSON and describe ------------------------------------------------------------------------------


def test_json_round_trip_is_exact() -> None:
    specs = [*ParamSpec.of(mlp()), ParamSpec("h", (3, 0), torch.float16), ParamSpec("q", (), torch.bfloat16)]
    placement = plan(specs, 3, split_bytes=MiB)
    text = placement.to_json()
    again = Placement.from_json(text)
    assert again == placement and again.to_json() == text
    assert json.loads(text)["params"][0]["dtype"] == "float32"
    assert again.spec("q").dtype is torch.bfloat16


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=99), "version"),
        (lambda d: d["shards"].pop(), "cover"),
        (lambda d: d["shards"][0].update(stop=d["shards"][0]["stop"] + 1), "gap|overlap|cover"),
        (lambda d: d["shards"][0].update(server=7), "not one of"),
        (lambda d: d["shards"][0].update(param="nope"), "no known parameter"),
        (lambda d: d["params"][0].update(dtype="qint8"), "dtype"),
        (lambda d: d.pop("shards"), "malformed"),
        (lambda d: d.update(servers=0), "at least one server"),
    ],
)
def test_from_json_refuses_inconsistent_placements(
    edit: Callable[[dict[str, Any]], object], message: str
) -> None:
    doc = json.loads(plan(ParamSpec.of(mlp()), 2, split_bytes=MiB).to_json())
    edit(doc)
    with pytest.raises(ValueError, match=message):
        Placement.from_json(json.dumps(doc))


def test_describe_names_every_server_and_parameter() -> None:
    placement = plan(ParamSpec.of(embedding_model()), 4)
    text = placement.describe()
    assert all(f"server {i}:" in text for i in range(4))
    assert all(p.name in text for p in placement.params)
    assert f"imbalance {placement.imbalance():.4f}" in text
    assert "[0:25600000) of 25600000" not in text  # the embedding is split, not shown whole


def test_lookups() -> None:
    placement = plan(ParamSpec.of(mlp()), 2, split_bytes=MiB)
    assert sum(len(placement.on_server(i)) for i in range(2)) == len(placement.shards)
    with pytest.raises(KeyError):
        placement.shards_of("missing")
    with pytest.raises(ValueError):
        placement.on_server(2)


@pytest.mark.parametrize("servers", [2, 3, 4])
def test_the_default_bound_spreads_a_model_of_few_big_tensors(servers: int) -> None:
    # 784-1024-1024-10: its 4 MiB weight would stay whole under a fixed 4 MiB bound (imbalance 1.69).
    mlp = torch.nn.Sequential(
        torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )  # fmt: skip
    assert plan(ParamSpec.of(mlp), servers).imbalance() <= 1.05
