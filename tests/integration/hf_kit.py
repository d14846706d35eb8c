"""What the tensorwire.hf tests share: tiny Llama models built from a config (no download), a
store on loopback, and bit-for-bit comparisons of models' states."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import tensorwire
from tensorwire.server import ServerOptions

transformers = pytest.importorskip("transformers")

TOKEN = "hf-test-token"


def tiny(*, tied: bool, seed: int) -> nn.Module:
    """A 2-layer Llama of ~70k parameters, its weights drawn from ``seed``."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        vocab_size=128, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(seed)
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model.eval()


@contextmanager
def store(capacity: int = 1 << 26) -> Iterator[tensorwire.ServerThread]:
    with tensorwire.ServerThread(
        ["tcp://127.0.0.1:0"], ServerOptions(token=TOKEN), store=tensorwire.TensorStore(capacity)
    ) as srv:
        yield srv


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, to compare bit for bit (NaNs and -0.0 included)."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).clone()


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model, parameters and all buffers (non-persistent ones too), as bytes."""
    found = {f"p:{n}": bits(t) for n, t in model.named_parameters(remove_duplicate=False)}
    found.update({f"b:{n}": bits(t) for n, t in model.named_buffers(remove_duplicate=False)})
    return found


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def served_reads(srv: tensorwire.ServerThread) -> int:
    """Bytes of tensor data the store sent for reads at a generation (not manifests)."""
    rows = srv.server.counts.rows.items()
    return sum(row.sent for (op, _), row in rows if op.startswith("gen_get"))
