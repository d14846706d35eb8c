"""The optimizers a parameter server runs, described so that they travel as JSON.

A server holds each shard as an ``nn.Parameter`` over a flat range of elements and steps it with
the ``torch.optim`` class named here. SGD (momentum, dampening, Nesterov, weight decay), Adam and
AdamW are element-wise, so stepping a parameter in pieces gives the numbers stepping it whole
does: a run on S servers matches ``torch.optim`` on one process (tests/integration/test_ps.py).

Workers say which optimizer they want with a spec (``ps.SGD(lr=0.1, momentum=0.9)``) or with a
``torch.optim`` instance whose class and defaults are read (``torch.optim.Adam(model.parameters(),
lr=1e-3)``); every worker of a job must ask for the same one (the server checks).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass(frozen=True)
class OptimizerSpec:
    """Base of the optimizer specs. Every field is the ``torch.optim`` keyword of the same name, so
    ``build`` is the torch class called with the fields."""

    KIND: ClassVar[str] = ""
    TORCH: ClassVar[type[torch.optim.Optimizer]]
    lr: float = 1e-3

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return self.TORCH(params, **dataclasses.asdict(self))

    def __post_init__(self) -> None:
        # torch checks the settings when it builds the optimizer: do it now, on a dummy, so that
        # a bad lr or betas is a ValueError here, not an internal error on a server.
        try:
            self.build([torch.nn.Parameter(torch.zeros(1))])
        except (ValueError, TypeError, IndexError, RuntimeError) as exc:
            raise ValueError(f"unusable {self.KIND} settings {dataclasses.asdict(self)}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.KIND, **dataclasses.asdict(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@dataclass(frozen=True)
class SGD(OptimizerSpec):
    KIND: ClassVar[str] = "sgd"
    TORCH: ClassVar[type[torch.optim.Optimizer]] = torch.optim.SGD
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


@dataclass(frozen=True)
class Adam(OptimizerSpec):
    KIND: ClassVar[str] = "adam"
    TORCH: ClassVar[type[torch.optim.Optimizer]] = torch.optim.Adam
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False


@dataclass(frozen=True)
class AdamW(Adam):
    KIND: ClassVar[str] = "adamw"
    TORCH: ClassVar[type[torch.optim.Optimizer]] = torch.optim.AdamW
    weight_decay: float = 1e-2


KINDS: dict[str, type[OptimizerSpec]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}
_TORCH: dict[type[torch.optim.Optimizer], type[OptimizerSpec]] = {
    torch.optim.SGD: SGD,
    torch.optim.Adam: Adam,
    torch.optim.AdamW: AdamW,
}


def spec_of(optimizer: OptimizerSpec | torch.optim.Optimizer | str) -> OptimizerSpec:
    """A spec from a spec, a ``torch.optim`` SGD/Adam/AdamW instance, or a name ("adam")."""
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if isinstance(optimizer, str):
        return from_dict({"kind": optimizer})
    spec_type = _TORCH.get(type(optimizer))
    if spec_type is Adam and optimizer.defaults.get("decoupled_weight_decay"):
        spec_type = AdamW  # what torch's AdamW is: Adam with decoupled weight decay
    if spec_type is None:
        raise ValueError(f"a parameter server runs SGD, Adam or AdamW, not {type(optimizer).__name__}")
    defaults = optimizer.defaults
    fields = {f.name: defaults[f.name] for f in dataclasses.fields(spec_type) if f.name in defaults}
    _refuse_unsupported(defaults)
    if "betas" in fields:
        fields["betas"] = tuple(fields["betas"])
    return spec_type(**{k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in fields.items()})


def from_dict(doc: dict[str, Any]) -> OptimizerSpec:
    doc = dict(doc)
    kind = doc.pop("kind", None)
    spec_type = KINDS.get(str(kind))
    if spec_type is None:
        raise ValueError(f"unknown optimizer {kind!r}; known: {', '.join(KINDS)}")
    unknown = set(doc) - {f.name for f in dataclasses.fields(spec_type)}
    if unknown:
        raise ValueError(f"unknown {kind} option(s): {', '.join(sorted(unknown))}")
    if "betas" in doc:
        doc["betas"] = tuple(doc["betas"])
    return spec_type(**doc)


def _refuse_unsupported(defaults: dict[str, Any]) -> None:
    """Options the server would silently ignore are refused instead."""
    for name in ("maximize", "capturable", "differentiable"):
        if defaults.get(name):
            raise ValueError(f"the parameter server does not support {name}=True")
