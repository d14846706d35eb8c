"""The names a transformers model's weights go by: what ``save_pretrained`` writes.

``save_pretrained`` writes the model's ``state_dict()`` (parameters and persistent buffers) less
``_keys_to_ignore_on_save`` and less the second name of every tied weight: tensors that are one
view of one storage are written once, and the names dropped are the ones the model declares tied
(``_tied_weights_keys`` of each submodule: a list of patterns in transformers 4, a ``{target:
source}`` dict in 5), matched with ``re.search`` in sorted order as transformers does
(``remove_tied_weights_from_state_dict``). A plain state dict declares no ties: of tensors that
share one view, the first in the dict's order is kept. Nothing here imports transformers.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from tensorwire.errors import InvalidTensor


@dataclass(frozen=True)
class SavedNames:
    """``tensors``: name -> tensor, as ``save_pretrained`` writes them (each storage view once);
    ``tied``: each name dropped because it is the same view as a kept one -> that kept name."""

    tensors: dict[str, torch.Tensor]
    tied: dict[str, str]


def saved_names(source: nn.Module | Mapping[str, torch.Tensor], *, keep_vars: bool = False) -> SavedNames:
    """The tensors of ``source`` (a model, or a state dict) by the names ``save_pretrained`` writes;
    ``keep_vars``: a model's own parameters rather than detached views of them."""
    if isinstance(source, nn.Module):
        state = dict(source.state_dict(keep_vars=keep_vars))
        for key in getattr(source, "_keys_to_ignore_on_save", None) or ():
            state.pop(key, None)
        patterns = tied_patterns(source)
    else:
        state, patterns = dict(source), []
    views: dict[Hashable, list[str]] = defaultdict(list)
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise InvalidTensor(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.numel() and tensor.device.type != "meta":  # empty tensors share no memory
            views[_view(tensor)].append(name)
    tied: dict[str, str] = {}
    for names in views.values():
        if len(names) > 1:
            dropped = _dropped(names, patterns)
            kept = next(n for n in names if n not in dropped)
            tied.update(dict.fromkeys(dropped, kept))
    return SavedNames({n: t for n, t in state.items() if n not in tied}, tied)


def tied_patterns(model: nn.Module) -> list[str]:
    """The tied names every submodule declares (``_tied_weights_keys``), as full-name patterns."""
    found: list[str] = []
    for prefix, module in model.named_modules():
        declared = getattr(module, "_tied_weights_keys", None) or ()
        keys = declared.keys() if isinstance(declared, Mapping) else declared
        found.extend(f"{prefix}.{key}" if prefix else str(key) for key in keys)
    return found


def _dropped(names: list[str], patterns: list[str]) -> list[str]:
    """Of ``names`` (one view of one storage), all but one: the declared tied names first (sorted,
    at most all but one of them, as transformers drops them), then every other name but the first."""
    declared = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)][: len(names) - 1]
    rest = [n for n in names if n not in declared]
    return declared + rest[1:]


def _view(tensor: torch.Tensor) -> Hashable:
    """What makes two tensors one view of one memory: the storage, where in it, and how laid out."""
    storage = tensor.untyped_storage()
    return (
        tensor.device, storage.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
        tensor.dtype,
    )  # fmt: skip
