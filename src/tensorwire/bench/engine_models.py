"""Small Llama checkpoints with random weights for vLLM engines (``bench engines`` and
tests/engines): built from a config, saved as safetensors, no download. head_dim stays 64 (the CPU
attention refuses 16); the float32 weights make an engine's logits comparable bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def build_llama(folder: Path, seed: int, *, hidden: int = 256, layers: int = 2, vocab: int = 512) -> Any:
    """A ``LlamaForCausalLM`` with weights drawn from ``seed``, saved to ``folder``; returned."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(hidden // 64, 1)
    # Any: transformers 5 ships its types, and vLLM's pinned transformers (where this runs) takes
    # torch_dtype, which 5's signature no longer names
    fields: dict[str, Any] = {
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": max(heads // 2, 1), "vocab_size": vocab,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": "float32",
    }  # fmt: skip
    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(LlamaConfig(**fields))
    model = model.to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def engine_args(folder: Path) -> dict[str, Any]:
    """``LLM(**engine_args(folder))``: a CPU engine on 2 cores, weights updated by tensorwire."""
    return {
        "model": str(folder), "skip_tokenizer_init": True, "gpu_memory_utilization": 0.1,
        "dtype": "float32", "max_model_len": 256, "enforce_eager": True, "seed": 0,
        "weight_transfer_config": {"backend": "tensorwire"},
    }  # fmt: skip
