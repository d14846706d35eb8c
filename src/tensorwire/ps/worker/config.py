"""What a ``Worker`` resolves once, when it is made: ``WorkerConfig``.

A worker's arguments leave much to its surroundings: the servers (``$TENSORWIRE_SERVERS``, or
torchrun's rendezvous store), its rank and world size (``$RANK``, ``$WORLD_SIZE``), its job
(``$TENSORWIRE_JOB``, else one derived from the model), its job token (``$TENSORWIRE_JOB_TOKEN``),
its TLS files and token (``$TENSORWIRE_TLS_*``, ``$TENSORWIRE_TOKEN``), codecs given by name.
``WorkerConfig.resolve`` reads all of that in one place and checks what cannot work together
(a sparse pull codec, error feedback without a push codec, relay pulls over anything but tcp:// or
tls://), raising ValueError before anything connects. The result is frozen: nothing a worker does
afterwards reads the environment again.

Which job: ``job=`` (an id: 1 to 64 letters, digits, ``.``, ``_``, ``-``), else ``$TENSORWIRE_JOB``,
else one derived from the model's parameter names, shapes and dtypes and the mode, so that a worker
of another model never joins a job silently. One set of servers runs several jobs at once; a
worker that names a job but runs another model, mode, optimizer or world is refused, naming the
difference.

Who owns the job: ``job_token=`` (a secret every worker of the job shares), else
``$TENSORWIRE_JOB_TOKEN``: the first worker's makes the job its own, and the servers refuse
(NotAuthorized) a worker that joins or initialises it with another or none, and a ``tensorwire ps
end`` without it (or the servers' operator token). ``tensorwire ps launch`` gives its workers
one. Without one the job is open: every client the servers admit may join or end it.

Where the servers are: ``servers=`` (URLs, or one comma-separated string), else
``$TENSORWIRE_SERVERS``, else (under ``torchrun``) what rank 0 published in torchrun's rendezvous
store. Rank and world size: ``rank=``/``world_size=``, else ``$RANK``/``$WORLD_SIZE`` (set by
torchrun and by ``tensorwire ps launch``), else 0 and 1.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tensorwire import transport as transports
from tensorwire.compression import Codec
from tensorwire.compression.codecs import resolve
from tensorwire.ps.job import Mode, default_job_id
from tensorwire.ps.optim import SGD, OptimizerSpec, spec_of
from tensorwire.ps.worker.relay_reader import check_relay_servers
from tensorwire.ps.worker.rendezvous import JOB_ENV, rank_and_world, resolve_servers
from tensorwire.ps.worker.rpc import JOB_TOKEN_ENV
from tensorwire.ps.worker.shards import model_digest
from tensorwire.security import Security, TlsFiles, client_security
from tensorwire.wire import ps as wps

__all__ = ["MARGIN", "PULLS", "WorkerConfig"]

# A request's own timer runs this much longer than the server's wait, so the server's answer
# (naming who it waited for) arrives before the client gives up.
MARGIN = 10.0
PULLS = ("direct", "relay")  # how a worker pulls: from each server, or through the servers' relays


@dataclass(frozen=True)
class WorkerConfig:
    """A worker's settings, resolved (see the module doc); ``Worker`` makes one from its arguments."""

    servers: tuple[str, ...]  # one entry per server: its replicas' URLs joined by "|"
    job: str
    model: str  # the model's digest (``shards.model_digest``): the servers check it is the job's
    mode: Mode
    optimizer: OptimizerSpec
    rank: int
    world_size: int
    timeout: float  # every wait: a pull waiting for a step, a barrier, a push's answer
    connect_timeout: float
    observer: bool  # pulls only, without joining (evaluation, checkpoints)
    heartbeat: float  # seconds between heartbeats (0: none); see ParamServer
    push_codec: Codec | None
    pull_codec: Codec | None
    error_feedback: bool  # keep what the push codec drops for the next step
    split_bytes: int | None  # the largest shard (placement.plan)
    security: Security  # TLS files for tls:// servers, the client token
    prefer_local: bool  # a server on this host that serves shm:// is reached through it
    relay: bool  # pull="relay": through the servers' relays
    job_token: bytes = field(repr=False)  # a secret the job's workers share: never logged or shown

    @classmethod
    def resolve(
        cls,
        params: dict[str, torch.nn.Parameter],
        servers: Sequence[str] | str | None = None,
        mode: str | Mode = "sync",
        optimizer: OptimizerSpec | torch.optim.Optimizer | str | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float = 120.0,
        connect_timeout: float = 10.0,
        split_bytes: int | None = None,
        token: str | None = None,
        tls: TlsFiles | None = None,
        observer: bool = False,
        heartbeat: float = 1.0,
        push_codec: Codec | str | None = None,
        pull_codec: Codec | str | None = None,
        error_feedback: bool | None = None,
        job: str | None = None,
        prefer_local: bool = True,
        pull: str = "direct",
        job_token: str | None = None,
    ) -> WorkerConfig:
        """The settings of a worker of the model whose parameters are ``params``, its arguments
        (``Worker``'s, less ``model`` and ``staging``) completed from the environment."""
        parsed = Mode.parse(mode)
        spec = spec_of(optimizer if optimizer is not None else SGD())
        rank, world_size = rank_and_world(rank, world_size)
        urls = tuple(resolve_servers(servers, rank, timeout))
        model = model_digest(params)
        push, pulled, feedback = _codecs(push_codec, pull_codec, error_feedback)
        return cls(
            servers=urls, job=_job(job, model, parsed), model=model, mode=parsed, optimizer=spec,
            rank=rank, world_size=world_size, timeout=timeout, connect_timeout=connect_timeout,
            observer=observer, heartbeat=heartbeat, push_codec=push, pull_codec=pulled,
            error_feedback=feedback, split_bytes=split_bytes, security=client_security(tls, token),
            prefer_local=prefer_local, relay=_relay(pull, pulled, urls), job_token=_job_token(job_token),
        )  # fmt: skip

    @property
    def options(self) -> transports.TransportOptions:
        """How the worker's connections are opened: a request waits ``timeout`` plus ``MARGIN``."""
        return transports.TransportOptions(
            self.connect_timeout,
            self.timeout + MARGIN,
            security=self.security,
            prefer_local=self.prefer_local,
        )


def _job(job: str | None, model: str, mode: Mode) -> str:
    """The job: named, or derived from the model and the mode (another model: another job)."""
    named = job if job is not None else os.environ.get(JOB_ENV) or None  # an empty variable: unset
    return wps.check_job_id(default_job_id(model, mode) if named is None else named)


def _job_token(job_token: str | None) -> bytes:
    token = (job_token or os.environ.get(JOB_TOKEN_ENV) or "").encode()
    if len(token) > wps.MAX_CREDENTIAL_BYTES:
        raise ValueError(f"a job token is at most {wps.MAX_CREDENTIAL_BYTES} bytes")
    return token


def _codecs(
    push_codec: Codec | str | None, pull_codec: Codec | str | None, error_feedback: bool | None
) -> tuple[Codec | None, Codec | None, bool]:
    push, pull = resolve(push_codec), resolve(pull_codec)
    if pull is not None and pull.sparse:
        raise ValueError(f"pull_codec {pull.name} drops elements: use int8, bf16 or fp16")
    if error_feedback is None:  # on by default wherever the codec loses something
        error_feedback = push is not None and push.lossy
    if error_feedback and push is None:
        raise ValueError("error_feedback needs a push_codec")
    return push, pull, error_feedback


def _relay(pull: str, pull_codec: Codec | None, servers: Sequence[str]) -> bool:
    """Whether the worker pulls through the relay; ValueError for what cannot go through one:
    quantised pulls (the relay moves the parameters as the server keeps them) and servers not on
    tcp:// or tls://. (A CUDA model cannot either: the worker checks that, once its tensors are
    placed.)"""
    if pull not in PULLS:
        raise ValueError(f"pull must be 'direct' or 'relay', not {pull!r}")
    if pull == "direct":
        return False
    if pull_codec is not None:
        raise ValueError("pull='relay' moves full-precision parameters: it takes no pull_codec")
    check_relay_servers(servers)
    return True
