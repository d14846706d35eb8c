"""tensorwire.hf.names: the names save_pretrained writes, without transformers: declared tied
names dropped (transformers 4's list of patterns and 5's dict, on submodules too), otherwise the
first of one view kept; ignored keys left out; empty tensors and distinct views of one storage
never taken for ties."""

from __future__ import annotations

import torch
from torch import nn

from tensorwire.hf.names import saved_names, tied_patterns


class Head(nn.Module):
    """Its ``proj.weight`` (registered first) is declared tied to ``embed.weight``."""

    def __init__(self, declared: object) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6, bias=False)
        self.embed = nn.Embedding(6, 4)
        self.proj.weight = self.embed.weight
        self._tied_weights_keys = declared


def test_the_declared_tied_name_is_dropped_even_when_it_comes_first() -> None:
    for declared in (["proj.weight"], {"proj.weight": "embed.weight"}):  # transformers 4, 5
        saved = saved_names(Head(declared))
        assert list(saved.tensors) == ["embed.weight"] and saved.tied == {"proj.weight": "embed.weight"}
    undeclared = saved_names(Head(None))  # nothing declared: the first in the state dict's order
    assert list(undeclared.tensors) == ["proj.weight"] and undeclared.tied == {"embed.weight": "proj.weight"}


def test_submodules_declare_their_ties_under_their_own_names() -> None:
    outer = nn.Module()
    outer.inner = Head(["proj.weight"])
    assert tied_patterns(outer) == ["inner.proj.weight"]
    assert list(saved_names(outer).tensors) == ["inner.embed.weight"]


def test_keys_to_ignore_on_save_are_left_out() -> None:
    model = nn.Linear(2, 2)
    model._keys_to_ignore_on_save = ["bias"]
    assert list(saved_names(model).tensors) == ["weight"]


def test_a_state_dict_keeps_the_first_of_one_view_and_only_true_views_are_ties() -> None:
    base = torch.arange(12.0)
    state = {
        "a": base[:6], "b": base[:6], "c": base[6:],  # b is a's view; c another view of one storage
        "d": base.view(3, 4), "e": torch.empty(0), "f": torch.empty(0),  # d: another shape; empties
    }  # fmt: skip
    saved = saved_names(state)
    assert list(saved.tensors) == ["a", "c", "d", "e", "f"] and saved.tied == {"b": "a"}
    assert saved.tensors["a"] is state["a"]  # the caller's tensors, not copies
