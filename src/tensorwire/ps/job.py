"""A parameter-server job: what every worker of it must agree on.

``Mode``, ``JobConfig`` (mode, optimizer, which model): what the first ``PS_INIT`` sets and every
later worker must ask for; ``CheckpointPolicy``: where and how often a server writes its job. A
worker describes its job with these, and loads nothing of the server to do so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tensorwire.errors import ProtocolError
from tensorwire.ps.optim import OptimizerSpec, from_dict

MAX_SSP_BOUND = 1 << 30
_MODEL = re.compile(r"\d{1,9}:[0-9a-f]{16,64}")  # JobConfig.model: "<parameters>:<digest>"


@dataclass(frozen=True)
class Mode:
    """``sync``, ``async`` or ``ssp:<s>``."""

    kind: str
    staleness: int = 0

    @staticmethod
    def parse(text: str | Mode) -> Mode:
        if isinstance(text, Mode):
            return text
        if not isinstance(text, str):  # from a peer's JSON
            raise ValueError(f"mode must be a string, not {type(text).__name__}")
        kind, _, bound = text.partition(":")
        if kind in ("sync", "async") and not bound:
            return Mode(kind)
        if kind == "ssp" and bound.isascii() and bound.isdigit() and int(bound) <= MAX_SSP_BOUND:
            return Mode("ssp", int(bound))
        raise ValueError(f"mode must be sync, async or ssp:<s> (s a whole number up to {MAX_SSP_BOUND}), "
                         f"not {text[:40]!r}")  # fmt: skip

    def __str__(self) -> str:
        return f"ssp:{self.staleness}" if self.kind == "ssp" else self.kind


@dataclass(frozen=True)
class JobConfig:
    """What every worker of a job must agree on; the first ``PS_INIT`` sets it. ``model`` says
    which model: ``"<parameters>:<digest>"`` of its parameters' names, shapes and dtypes (``""``:
    not said, by an older worker; the shards are compared in any case)."""

    mode: Mode
    optimizer: OptimizerSpec
    model: str = ""

    def to_json(self) -> str:
        doc = {"mode": str(self.mode), "optimizer": self.optimizer.to_dict()}
        if self.model:
            doc["model"] = self.model
        return json.dumps(doc, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> JobConfig:
        """The config a peer sent, checked completely: known keys only, every setting of a known
        type and in range (ProtocolError naming what is wrong)."""
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict):
                raise TypeError(f"a config is a JSON object, not {type(doc).__name__}")
            unknown = sorted(set(doc) - {"mode", "optimizer", "model"})
            if unknown:
                raise ValueError(f"unknown key(s) {', '.join(repr(k[:40]) for k in unknown[:8])}")
            model = doc.get("model", "")
            if not isinstance(model, str) or (model and not _MODEL.fullmatch(model)):
                raise ValueError("model must be '<parameters>:<hex digest>'")
            return JobConfig(Mode.parse(doc["mode"]), from_dict(doc["optimizer"]), model)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ProtocolError(f"unusable parameter-server config: {exc}") from exc

    def differences(self, asked: JobConfig) -> list[str]:
        """How the job ``asked`` for differs from this one, one phrase per setting."""
        diffs = [f"mode {self.mode} here, {asked.mode} asked"] if self.mode != asked.mode else []
        mine, theirs = self.optimizer.to_dict(), asked.optimizer.to_dict()
        if mine["kind"] != theirs["kind"]:
            diffs.append(f"optimizer {mine['kind']} here, {theirs['kind']} asked")
        else:
            diffs += [f"optimizer {k} {mine[k]} here, {theirs[k]} asked" for k in sorted(mine)
                      if mine[k] != theirs[k]]  # fmt: skip
        if self.model and asked.model and self.model != asked.model:
            (n, digest), (m, other) = self.model.split(":"), asked.model.split(":")
            diffs.append(f"the model's parameters (names, shapes or dtypes) differ: {n} here (digest "
                         f"{digest[:12]}), {m} asked (digest {other[:12]})")  # fmt: skip
        return diffs


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where and how often a server writes its checkpoints (and it always does at SIGTERM)."""

    directory: Path
    every_steps: int = 0  # after every this many updates (0: not by count)
    every_seconds: float = 0.0  # after the first update this long after the last one (0: not by time)
