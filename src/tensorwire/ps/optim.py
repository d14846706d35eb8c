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
import math
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
        # Settings travel from peers (PS_INIT): each is checked for its type and range here, and
        # then torch checks them too, on a dummy, so that a bad lr or betas is a ValueError here,
        # never an internal error (or NaN parameters) on a server.
        try:
            for f in dataclasses.fields(self):
                object.__setattr__(self, f.name, _checked(f.name, getattr(self, f.name)))
            self.build([torch.nn.Parameter(torch.zeros(1))])
        except (ValueError, TypeError, IndexError, RuntimeError) as exc:
            raise ValueError(f"unusable {self.KIND} settings {_shown(self)}: {exc}") from None

    @property
    def state_copies(self) -> int:
        """How many tensors the size of the parameters ``torch.optim`` keeps as state (momentum,
        moments): what a server must hold beside the parameters (ps/budget.py)."""
        return 0

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

    @property
    def state_copies(self) -> int:
        return 1 if self.momentum else 0  # the momentum buffer


@dataclass(frozen=True)
class Adam(OptimizerSpec):
    KIND: ClassVar[str] = "adam"
    TORCH: ClassVar[type[torch.optim.Optimizer]] = torch.optim.Adam
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False

    @property
    def state_copies(self) -> int:
        return 3 if self.amsgrad else 2  # the first and second moments (and their maximum)


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
    """The spec a JSON document describes (a peer's PS_INIT): known kinds and keys only, each
    setting checked for its type and range (``OptimizerSpec.__post_init__``)."""
    if not isinstance(doc, dict):
        raise ValueError(f"an optimizer is a JSON object, not {type(doc).__name__}")
    doc = dict(doc)
    kind = doc.pop("kind", None)
    spec_type = KINDS.get(kind) if isinstance(kind, str) else None
    if spec_type is None:
        raise ValueError(f"unknown optimizer {str(kind)[:40]!r}; known: {', '.join(KINDS)}")
    unknown = set(doc) - {f.name for f in dataclasses.fields(spec_type)}
    if unknown:
        shown = ", ".join(repr(str(k)[:40]) for k in sorted(unknown)[:8])
        raise ValueError(f"unknown {kind} option(s): {shown}")
    return spec_type(**doc)


# Each setting's range: (lowest, highest, whether the highest is allowed). Every one is also finite.
_RANGES: dict[str, tuple[float, float, bool]] = {
    "lr": (0.0, math.inf, True),
    "momentum": (0.0, 1.0, True),
    "dampening": (0.0, 1.0, True),
    "weight_decay": (0.0, math.inf, True),
    "eps": (0.0, math.inf, True),
    "beta": (0.0, 1.0, False),
}
_FLAGS = ("nesterov", "amsgrad")


def _checked(name: str, value: Any) -> Any:
    """``value`` as the setting ``name`` takes it (numbers as floats), or ValueError saying why."""
    if name in _FLAGS:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, not {_short(value)}")
        return value
    if name == "betas":
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"betas must be two numbers, not {_short(value)}")
        return tuple(_number("beta", v) for v in value)
    if name not in _RANGES:
        raise ValueError(f"unknown setting {name!r}")
    return _number(name, value)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, not {_short(value)}")
    low, high, closed = _RANGES[name]
    try:
        number = float(value)
    except OverflowError:  # a whole number too large for a float
        number = math.inf
    if not math.isfinite(number) or number < low or number > high or (number == high and not closed):
        bound = f"at least {low:g}" if high == math.inf else f"from {low:g} to {high:g}"
        raise ValueError(f"{name} must be a finite number {bound}{'' if closed else ' (exclusive)'}, "
                         f"not {_short(value)}")  # fmt: skip
    return number


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def _shown(spec: OptimizerSpec) -> str:
    """The settings, for an error message (bounded: a peer chose them)."""
    text = repr({f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)})
    return text if len(text) <= 200 else text[:200] + "..."


def _refuse_unsupported(defaults: dict[str, Any]) -> None:
    """Options the server would silently ignore are refused instead."""
    for name in ("maximize", "capturable", "differentiable"):
        if defaults.get(name):
            raise ValueError(f"the parameter server does not support {name}=True")
