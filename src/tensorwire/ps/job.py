"""A parameter-server job: what every worker of it must agree on, and one server's part of it.

* ``Mode``, ``JobConfig`` (mode, optimizer, which model): what the first ``PS_INIT`` sets and
  every later worker must ask for; ``CheckpointPolicy``: where and how often a server writes its
  jobs. A worker describes its job with these (and loads nothing of the server to do so).
* A job has an id (``wire.ps.check_job_id``): the worker's ``job=``, else ``$TENSORWIRE_JOB``,
  else ``default_job_id`` of its model and mode, so that a worker of another model never lands in
  a job silently. A server holds several jobs, each its own ``Job`` (ps/server/jobs.py). Its
  parameters, published for relay pulls, go under ``relay_prefix(job)``.
* ``Job``: one server's shards of the job's parameters (``HeldShard``, each an ``nn.Parameter``
  over a flat range), their ``torch.optim`` optimizer, the one thread that steps them and the lock
  pulls read them under, and the job's counters (world, step, version, pushes).
* The checks: the records a worker sends (``check_records``), its rank and world
  (``Job.check_worker``), and its job (``Job.check_same_job``): a worker that names a job but runs
  another (model, mode, optimizer, world) is refused naming every difference.
* Who owns a job (``Job.owner``, ``Job.check_owner``, ``Job.claim``): the holders of its job
  token, a secret its workers share (``$TENSORWIRE_JOB_TOKEN``; ``tensorwire ps launch`` makes one
  per run). The first PS_JOIN admitted into a job (its rank and model checked, under the step lock)
  makes the token it offers the job's (its SHA-256 digest is kept, in checkpoints and state
  transfers too); a request that fails, or a PS_INIT, never claims one (a job restored from a
  checkpoint older than job tokens, or opened by a backup, stays unclaimed until its own worker
  joins); every later PS_JOIN and PS_INIT must offer the same, and
  PS_END the same or the servers' operator token (ps/server/lifecycle.py), else NotAuthorized naming what
  was missing. A job opened without a token is open: every client the server admits may join or
  end it, as before job tokens (the server says so in its log, when it requires a client token,
  and in PS_STATS: ``owner``). Requests that act as a rank need no token: they are bound to the
  session that joined with it (ps/server/membership.py), which offered it.

Lifecycle of a ``Job``: empty until a worker's ``PS_INIT`` (or a backup's CREATE) ``install``s
the shards, or a checkpoint or state transfer is loaded into it (ps/server/state.py); its counters then
move under the modes (ps/server/consistency.py); ``free`` lets go of its tensors when the job ends, and
``shutdown`` ends its thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from tensorwire.errors import CapacityExceeded, InvalidTensor, NotAuthorized, ProtocolError
from tensorwire.logs import event
from tensorwire.ps.budget import Budget
from tensorwire.ps.optim import OptimizerSpec, from_dict
from tensorwire.store.generations import SERVER_PREFIX
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps

log = logging.getLogger("tensorwire.ps")
T = TypeVar("T")
MAX_WORLD = 1 << 16
MAX_SSP_BOUND = 1 << 30
_MODEL = re.compile(r"\d{1,9}:[0-9a-f]{16,64}")  # JobConfig.model: "<parameters>:<digest>"
OPEN = b""  # the owner of a job opened without a job token: every client the server admits
TOKEN_HELP = "$TENSORWIRE_JOB_TOKEN, ps.Worker(job_token=...)"


def token_digest(token: bytes) -> bytes:
    """What a server keeps of a job token (never the token): its SHA-256; ``OPEN`` for none."""
    return hashlib.sha256(token).digest() if token else OPEN


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


@dataclass(eq=False)
class HeldShard:
    """One shard of the job's parameters that this server holds."""

    key: str
    param: torch.nn.Parameter  # flat, 1-D
    version: int = 0

    @property
    def meta(self) -> TensorMeta:
        p = self.param
        return TensorMeta(self.key, p.dtype, (p.numel(),), p.numel() * p.element_size(), self.version)


class SharedLock:
    """Many readers (pulls) or one writer (a step); a waiting writer goes before new readers."""

    def __init__(self) -> None:
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            async with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._changed:
            self._writers_waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._writer and not self._readers)
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            async with self._changed:
                self._writer = False
                self._changed.notify_all()


class Job:
    """One server's part of a job (see the module doc): changed on the event loop only; the
    optimizer's work runs on ``run``'s one thread, under ``lock`` where it touches the values."""

    def __init__(self, budget: Budget, job_id: str = "") -> None:
        self.id = job_id
        self.budget = budget
        self.config: JobConfig | None = None
        self.shards: dict[str, HeldShard] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self.world = 0
        self.step = 0  # sync: steps taken; the clock the next step is for
        self.version = 0  # updates applied, in any mode
        self.pushes = 0
        self.generation = 0  # bumped when the shards are replaced (a job created, a checkpoint restored)
        self.jobs_refused = 0  # joins and inits of another job (model, mode, optimizer, world)
        # The digest of its job token (``token_digest``); OPEN: none; None: not claimed yet (a job
        # opened by a backup before its primary said, or restored from a checkpoint without one).
        self.owner: bytes | None = None
        self.unauthorized = 0  # joins, inits and ends refused: not the job's token
        self.lock = SharedLock()  # pulls copy the values shared; a step or a checkpoint exclusive
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tensorwire-ps")

    @property
    def mode(self) -> Mode | None:
        return self.config.mode if self.config else None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the optimizer's thread (torch releases the GIL: the loop goes on)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def shutdown(self, wait: bool = True) -> None:
        self._thread.shutdown(wait=wait)

    def free(self) -> None:
        """The job ended: let go of its parameters and optimizer (its counters stay readable)."""
        self.shards = {}
        self.optimizer = None
        self.generation += 1
        self.budget.set("params", 0)
        self.budget.set("optimizer", 0)

    def install(
        self, world: int, config: JobConfig, metas: list[TensorMeta], values: list[torch.Tensor]
    ) -> None:
        """Make the shards of a new job from a worker's values (or the primary's: a backup)."""
        shards = {
            m.name: HeldShard(m.name, torch.nn.Parameter(v)) for m, v in zip(metas, values, strict=True)
        }
        self.optimizer = config.optimizer.build(s.param for s in shards.values())
        self.shards, self.config = shards, config
        self.count()
        self.generation += 1
        self.note_world(world)
        log.info("job %s initialised: %d shards, mode %s, %s", self.id, len(shards), config.mode,
                 config.optimizer)  # fmt: skip

    def count(self) -> None:
        """The job's parameters and its optimizer's state, in the budget (made or restored)."""
        assert self.config is not None
        params = sum(s.meta.nbytes for s in self.shards.values())
        self.budget.set("params", params)
        self.budget.set("optimizer", params * self.config.optimizer.state_copies)

    def note_world(self, world: int) -> None:
        self.world = max(self.world, world)

    def shard(self, name: str) -> HeldShard:
        shard = self.shards.get(name)
        if shard is None:
            raise ProtocolError(f"this server holds no shard {name!r}")
        return shard

    def describe(self) -> str:
        return self.config.to_json() if self.config else "nothing yet"

    # -- checks ---------------------------------------------------------------------------------
    def owned_by(self, credential: bytes) -> bool:
        """Whether ``credential`` is this job's token (or none, for an open or unclaimed one)."""
        if self.owner is None:
            return True
        return hmac.compare_digest(self.owner, token_digest(credential))

    def check_owner(self, credential: bytes, what: str) -> None:
        """A request that joins or initialises the job offered ``credential`` (its job token; b"":
        none): it must be the job's, else NotAuthorized (counted, logged) naming what was missing,
        before anything changes. An unclaimed job (``owner`` None) lets it by and stays unclaimed:
        only a join that is admitted claims it (``claim``), so a request that fails its other
        checks (a non-member's PS_INIT, a PS_JOIN of another rank or model) claims nothing."""
        if not self.owned_by(credential):
            raise self.refuse(credential, what)

    def claim(self, credential: bytes) -> bool:
        """An admitted join's ``credential`` becomes the owner of an unclaimed job (True: claimed
        now; False: the job had an owner, which ``check_owner`` compared it to)."""
        if self.owner is not None:
            return False
        self.owner = token_digest(credential)
        return True

    def refuse(self, credential: bytes, what: str, operator: bool = False) -> NotAuthorized:
        """The NotAuthorized for ``what`` offering ``credential`` (counted; logged the first time,
        then at every power of two); ``operator``: the servers' operator token would do too."""
        self.unauthorized += 1
        if self.unauthorized & (self.unauthorized - 1) == 0:
            event(log, logging.WARNING, "refused a request: not the job's token", job=self.id, request=what,
                  offered=bool(credential), refused_so_far=self.unauthorized)  # fmt: skip
        also = " or the servers' operator token (--operator-token-file)" if operator else ""
        if self.owner == OPEN:
            return NotAuthorized(
                f"{what}: job {self.id!r} was started without a job token, and this request offers "
                "one: it is another job (another job needs another id, ps.Worker(job=...))"
            )
        if not credential:
            return NotAuthorized(
                f"{what}: job {self.id!r} belongs to the holders of its job token ({TOKEN_HELP}){also}; "
                "this request offers none"
            )
        return NotAuthorized(
            f"{what}: job {self.id!r} belongs to the holders of another job token{also} than the one "
            "this request offers (another job needs another id, ps.Worker(job=...))"
        )

    def check_worker(self, head: wps.PsHead) -> None:
        if head.worker == wps.OBSERVER:
            raise ProtocolError("an observer cannot join or create a job")
        if not 0 < head.world <= MAX_WORLD or head.worker >= head.world:
            raise ProtocolError(f"worker {head.worker} of a world of {head.world} is not a valid rank")
        if self.world and head.world != self.world:
            raise ProtocolError(
                f"worker {head.worker} says the world has {head.world} workers; it has {self.world}"
            )

    def check_joining_job(self, job: tuple[JobConfig, list[TensorMeta]] | None) -> None:
        if job is not None and self.config is not None:
            self.check_same_job(*job)

    def check_same_job(self, config: JobConfig, metas: Sequence[TensorMeta]) -> None:
        """ProtocolError naming every difference between the job here and the one a worker that
        names it runs (another job needs another job id)."""
        assert self.config is not None
        diffs = self.config.differences(config) + self._shard_differences(metas)
        if diffs:
            self.jobs_refused += 1
            said = "; ".join(diffs[:8])
            event(log, logging.WARNING, "a worker of another job was refused", job=self.id, differences=said)
            raise ProtocolError(
                f"job {self.id!r} runs {self.describe()}; a worker asked for another job under its id: "
                f"{said} (another job needs another id: ps.Worker(job=...) or $TENSORWIRE_JOB)"
            )

    def _shard_differences(self, metas: Sequence[TensorMeta]) -> list[str]:
        """How a worker's shards (its model, placed over the servers) differ from this job's."""
        mine = {s.key: (s.param.dtype, s.param.numel()) for s in self.shards.values()}
        theirs = {m.name: (m.dtype, m.numel) for m in metas}
        diffs = []
        if extra := [k for k in theirs if k not in mine]:
            diffs.append(f"shard(s) {_few(extra)} of the worker's model are not in this job")
        if missing := [k for k in mine if k not in theirs]:
            diffs.append(f"this job's shard(s) {_few(missing)} are not in the worker's model")
        for key in [k for k in mine if k in theirs and mine[k] != theirs[k]][:4]:
            (dtype, n), (other, m) = mine[key], theirs[key]
            diffs.append(f"shard {key[:60]!r} is {n} x {dtype} here, {m} x {other} asked")
        return diffs


def relay_prefix(job: str) -> str:
    """The generation prefix a job's parameters are published under for relay pulls: the servers
    publish there (ps/server/relay.py) and the workers read there (ps/worker/relay_reader.py)."""
    return f"{SERVER_PREFIX}/{job}"


def relay_name(job: str, key: str) -> str:
    """The published name of shard ``key`` of ``job``."""
    return f"{relay_prefix(job)}/{key}"


def default_job_id(model: str, mode: Mode) -> str:
    """The job id of a worker that names none: its model's digest (``JobConfig.model``: parameter
    names, shapes, dtypes) and its mode, so that another model or mode is another job."""
    digest = hashlib.sha256(f"{model}|{mode}".encode()).hexdigest()[:16]
    return f"{mode.kind}-{digest}"


def described_job(reader: wm.MetaReader) -> tuple[JobConfig, list[TensorMeta]] | None:
    """The job a PS_JOIN says its worker belongs to (PS_INIT's config and records), if it does."""
    if not reader.remaining:
        return None  # an older worker: its PS_INIT checks the job
    config = JobConfig.from_json(wps.decode_config(reader))
    metas = wm.decode_records(reader)
    check_records(metas, None)
    return config, metas


def check_records(metas: Sequence[TensorMeta], data_len: int | None) -> None:
    if data_len is not None and sum(m.nbytes for m in metas) != data_len:
        raise InvalidTensor("the records' sizes do not add up to the frame's data length")
    for meta in metas:
        if len(meta.shape) != 1 or not meta.dtype.is_floating_point:
            raise InvalidTensor(f"shard {meta.name!r} must be a flat floating-point range")


def check_replicated(metas: Sequence[TensorMeta], data_len: int, capacity: int) -> None:
    """A replicated job's values: as a worker's PS_INIT is checked, before a byte is allocated."""
    check_records(metas, data_len)
    if data_len > capacity:
        raise CapacityExceeded(f"{data_len} bytes of parameters exceed {capacity}")


def _few(names: Sequence[str]) -> str:
    """A few of ``names``, for an error message (a peer chose them: bounded)."""
    shown = ", ".join(repr(name[:60]) for name in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")
