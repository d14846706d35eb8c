"""tensorwire.hf against a real store on loopback: a tiny Llama (tied and untied) published and
loaded into a fresh model bit for bit, agreeing with save_pretrained -> from_pretrained on every
name and byte; a sharded save_pretrained checkpoint through publish_checkpoint and through
``tensorwire put --generation``; tied weights sent once and still tied after a load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hf_kit import TOKEN, bits, same_state, snapshot, store, tiny, transformers
from safetensors import safe_open
from torch import nn

import tensorwire
import tensorwire.hf
from tensorwire import cli
from tensorwire.hf import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME


def written_names(folder: Path) -> set[str]:
    """Every tensor name save_pretrained wrote into ``folder``, from the files themselves."""
    names: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def pointers(model: nn.Module) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_publish_then_load_into_matches_save_pretrained(tied: bool, tmp_path: Path) -> None:
    source, fresh = tiny(tied=tied, seed=0), tiny(tied=tied, seed=1)
    assert not same_state(snapshot(source), snapshot(fresh))  # the load has something to do
    source.save_pretrained(tmp_path)
    before = pointers(fresh)
    with store() as srv:
        gen = tensorwire.hf.publish(source, srv.url, "policy", token=TOKEN)
        assert {n.removeprefix("policy/") for n in gen.names} == written_names(tmp_path)
        assert tensorwire.hf.load_into(fresh, srv.url, "policy", token=TOKEN) == gen.number
    assert pointers(fresh) == before  # in place: the model's own memory, no parameter replaced
    assert same_state(snapshot(fresh), snapshot(source))
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert same_state(snapshot(fresh), snapshot(reloaded))
    ids = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        assert torch.equal(bits(fresh(ids).logits), bits(source(ids).logits))


def test_tied_weights_are_sent_once_and_stay_tied() -> None:
    source, fresh = tiny(tied=True, seed=0), tiny(tied=True, seed=1)
    embed = source.model.embed_tokens.weight
    unique = {p.data_ptr(): p.nbytes for p in source.parameters()}
    with store() as srv:
        gen = tensorwire.hf.publish(source, srv.url, "policy", token=TOKEN)
        assert "policy/lm_head.weight" not in gen.names and "policy/model.embed_tokens.weight" in gen.names
        assert gen.nbytes == sum(unique.values())  # the tied matrix counted once
        received = sum(row.received for row in srv.server.counts.rows.values())
        assert sum(unique.values()) <= received < sum(unique.values()) + embed.nbytes  # not twice
        tensorwire.hf.load_into(fresh, srv.url, "policy", token=TOKEN)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    assert torch.equal(bits(fresh.lm_head.weight), bits(embed))


def test_a_state_dict_publishes_and_an_older_generation_loads() -> None:
    first, second, fresh = tiny(tied=False, seed=0), tiny(tied=False, seed=2), tiny(tied=False, seed=1)
    with store() as srv:
        one = tensorwire.hf.publish(first.state_dict(), srv.url, "policy", token=TOKEN)
        two = tensorwire.hf.publish(second, srv.url, "policy", token=TOKEN)
        assert two.number == one.number + 1 and one.names == two.names
        assert tensorwire.hf.load_into(fresh, srv.url, "policy", at=one.number, token=TOKEN) == one.number
    assert same_state(snapshot(fresh), snapshot(first))


class WithBuffers(nn.Module):
    """A persistent buffer is saved (and loaded); a non-persistent one is neither."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.linear = nn.Linear(4, 3)
        self.register_buffer("steps", torch.randint(0, 100, (5,), generator=gen))
        self.register_buffer("scratch", torch.randn(2, generator=gen), persistent=False)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(3, 4, generator=gen))
            self.linear.bias.copy_(torch.randn(3, generator=gen))


def test_persistent_buffers_travel_as_save_pretrained_writes_them() -> None:
    source, fresh = WithBuffers(0), WithBuffers(1)
    scratch = bits(fresh.scratch)
    with store() as srv:
        gen = tensorwire.hf.publish(source, srv.url, "m", token=TOKEN)
        assert set(gen.names) == {"m/linear.weight", "m/linear.bias", "m/steps"}
        tensorwire.hf.load_into(fresh, srv.url, "m", token=TOKEN)
    assert torch.equal(fresh.steps, source.steps) and torch.equal(fresh.linear.weight, source.linear.weight)
    assert torch.equal(bits(fresh.scratch), scratch)  # not saved, not touched


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_sharded_checkpoint_through_publish_checkpoint(tied: bool, tmp_path: Path) -> None:
    source, fresh = tiny(tied=tied, seed=0), tiny(tied=tied, seed=1)
    source.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())
    assert not (tmp_path / SAFE_WEIGHTS_NAME).exists() and len(set(index["weight_map"].values())) > 1
    with store() as srv:
        gen = tensorwire.hf.publish_checkpoint(tmp_path, srv.url, "ckpt", token=TOKEN)
        assert {n.removeprefix("ckpt/") for n in gen.names} == set(index["weight_map"])
        assert tensorwire.hf.load_into(fresh, srv.url, "ckpt", token=TOKEN) == gen.number
        again = tensorwire.hf.publish_checkpoint(
            tmp_path / SAFE_WEIGHTS_INDEX_NAME, srv.url, "ckpt", token=TOKEN
        )
        assert again.digest == gen.digest  # the index itself names the same generation
    assert same_state(snapshot(fresh), snapshot(source))


def test_single_file_checkpoint(tmp_path: Path) -> None:
    source, fresh = tiny(tied=True, seed=0), tiny(tied=True, seed=1)
    source.save_pretrained(tmp_path)
    assert (tmp_path / SAFE_WEIGHTS_NAME).is_file()
    with store() as srv:
        one = tensorwire.hf.publish_checkpoint(tmp_path, srv.url, "ckpt", token=TOKEN)
        two = tensorwire.hf.publish_checkpoint(tmp_path / SAFE_WEIGHTS_NAME, srv.url, "ckpt", token=TOKEN)
        published = tensorwire.hf.publish(source, srv.url, "ckpt", token=TOKEN)
        assert one.digest == two.digest == published.digest  # file and model: the same generation
        tensorwire.hf.load_into(fresh, srv.url, "ckpt", token=TOKEN)
    assert same_state(snapshot(fresh), snapshot(source))


def test_cli_put_generation_of_a_sharded_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, fresh = tiny(tied=True, seed=0), tiny(tied=True, seed=1)
    source.save_pretrained(tmp_path, max_shard_size="100KB")
    monkeypatch.setenv("TENSORWIRE_TOKEN", TOKEN)
    runner = CliRunner()
    with store() as srv:
        for path in (tmp_path, tmp_path / SAFE_WEIGHTS_INDEX_NAME):
            result = runner.invoke(cli.main, ["put", "--generation", "ckpt", str(path), "--server", srv.url])
            assert result.exit_code == 0, result.output
            assert (
                "ckpt  generation" in result.output
                and f"{len(written_names(tmp_path))} tensors" in result.output
            )
        assert tensorwire.hf.load_into(fresh, srv.url, "ckpt", token=TOKEN) == 2
        plain = runner.invoke(cli.main, ["put", "w", str(tmp_path), "--server", srv.url])
        assert plain.exit_code == 1 and "--generation" in plain.output
    assert same_state(snapshot(fresh), snapshot(source))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_a_model_on_a_cuda_device_publishes_and_loads() -> None:
    """Device tensors are sent from host copies and read through host memory, then copied in."""
    source, fresh = tiny(tied=True, seed=0).cuda(), tiny(tied=True, seed=1).cuda()
    before = pointers(fresh)
    with store() as srv:
        tensorwire.hf.publish(source, srv.url, "policy", token=TOKEN)
        tensorwire.hf.load_into(fresh, srv.url, "policy", token=TOKEN)
    assert pointers(fresh) == before and fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert same_state(snapshot(fresh), snapshot(source))
