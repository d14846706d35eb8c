"""tensorwire.hf.load_into reads a generation a peer published into a model's own memory: every
name maps only onto a tensor the model saves, every shape and dtype is checked against the
generation's manifest first, and a refusal leaves the model as it was with no tensor data read.

Each test publishes a hostile generation to a real store on loopback, asks a fresh model to load
it, and checks the refusal names the culprit, every byte of the model (parameters and all buffers)
is unchanged, and the store sent no tensor data for it."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from hf_kit import TOKEN, served_reads, snapshot, store, tiny

import tensorwire
import tensorwire.hf
from tensorwire.errors import LayoutMismatch
from tensorwire.hf.names import saved_names
from tensorwire.hf.weights import plan
from tensorwire.types import GenerationManifest


def weights(*, tied: bool) -> dict[str, torch.Tensor]:
    return dict(saved_names(tiny(tied=tied, seed=0)).tensors)


def refused(tensors: dict[str, torch.Tensor], naming: str, *, tied: bool = True) -> None:
    """Generation ``tensors`` refused by a fresh model, naming ``naming``; the model untouched,
    no tensor data read."""
    model = tiny(tied=tied, seed=1)
    before = snapshot(model)
    with store() as srv:
        with tensorwire.connect(srv.url, token=TOKEN) as client:
            client.publish("policy", tensors)
        with pytest.raises(LayoutMismatch, match=naming):
            tensorwire.hf.load_into(model, srv.url, "policy", token=TOKEN)
        assert served_reads(srv) == 0
    after = snapshot(model)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_a_name_the_model_lacks_is_refused() -> None:
    refused({**weights(tied=True), "model.layers.2.mlp.up_proj.weight": torch.ones(128, 64)}, "up_proj")


def test_a_tensor_the_generation_lacks_is_refused() -> None:
    tensors = weights(tied=True)
    del tensors["model.norm.weight"]
    refused(tensors, "lacks 1 tensor.*model.norm.weight")


def test_a_buffer_the_model_does_not_save_is_refused() -> None:
    inv_freq = tiny(tied=True, seed=0).model.rotary_emb.inv_freq
    refused({**weights(tied=True), "model.rotary_emb.inv_freq": torch.zeros_like(inv_freq)}, "buffer")


@pytest.mark.parametrize(
    "name", ["model/embed_tokens.weight", "model.norm.weight/x", "x/model.norm.weight", "model..norm.weight"]
)
def test_path_like_names_are_refused(name: str) -> None:
    refused({**weights(tied=True), name: torch.ones(64)}, "no tensor of this model")


def test_a_tied_weight_sent_apart_is_refused() -> None:
    """lm_head.weight is model.embed_tokens.weight in a tied model: a generation of an untied one
    would untie (or half-fill) it."""
    refused(weights(tied=False), "lm_head.weight.*ties to 'model.embed_tokens.weight'", tied=True)


def test_a_wrong_shape_is_refused_before_any_byte() -> None:
    tensors = weights(tied=True)
    tensors["model.layers.1.self_attn.o_proj.weight"] = torch.ones(64, 32)  # a last name, after others fit
    refused(tensors, r"o_proj.weight.*\[64, 32\].*\[64, 64\]")


def test_a_wrong_dtype_is_refused_before_any_byte() -> None:
    tensors = weights(tied=True)
    tensors["model.layers.0.input_layernorm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    refused(tensors, "input_layernorm.*bfloat16")


def test_a_manifest_the_server_answers_is_checked_too() -> None:
    """What a hostile server could answer to MANIFEST: a name outside the prefix, a name twice, or
    another generation than the one asked for."""
    model = tiny(tied=True, seed=1)
    saved = saved_names(model, keep_vars=True)
    with store() as srv:
        tensorwire.hf.publish(tiny(tied=True, seed=0), srv.url, "policy", token=TOKEN)
        tensorwire.hf.publish(tiny(tied=True, seed=0), srv.url, "policy", token=TOKEN)
        with tensorwire.connect(srv.url, token=TOKEN) as client:
            good = client.manifest("policy", 1)
    assert plan(good, "policy", 1, saved, model) == 1
    first = good.tensors[0]
    outside = replace(first, meta=first.meta._replace(name="other/" + first.meta.name.split("/", 1)[1]))
    cases: list[tuple[GenerationManifest, str]] = [
        (replace(good, tensors=(outside, *good.tensors[1:])), "twice or apart"),
        (replace(good, tensors=(*good.tensors, first)), "twice or apart"),
        (replace(good, generation=replace(good.generation, number=2)), "asked for generation 1"),
        (replace(good, generation=replace(good.generation, prefix="other")), "asked for generation 1"),
    ]
    for manifest, naming in cases:
        with pytest.raises(LayoutMismatch, match=naming):
            plan(manifest, "policy", 1, saved, model)
