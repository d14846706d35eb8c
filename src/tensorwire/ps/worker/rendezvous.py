"""Where a worker finds its job: the servers' URLs, its rank and the world size, the job's id.

Servers: given, else ``$TENSORWIRE_SERVERS``, else (under ``torchrun``) what rank 0 published in
torchrun's rendezvous store (``resolve_servers``). Rank and world size: given, else ``$RANK`` and
``$WORLD_SIZE`` (set by torchrun and by ``tensorwire ps launch``), else the default (``env_int``).
The job: given, else ``$TENSORWIRE_JOB`` (``JOB_ENV``), else derived from the model and mode
(``ps.Worker``); a reader that names none finds the one job of its model (``find_job``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from tensorwire.errors import ProtocolError, TensorwireError
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.ps.worker.shards import check_params, model_digest
from tensorwire.security import TlsFiles, client_security
from tensorwire.wire.ps import check_job_id

JOB_ENV = "TENSORWIRE_JOB"  # the job id of workers that name none
SERVERS_ENV = "TENSORWIRE_SERVERS"
STORE_KEY = "tensorwire/servers"


def resolve_servers(servers: Sequence[str] | str | None, rank: int, timeout: float) -> list[str]:
    """The servers' URLs: given, else ``$TENSORWIRE_SERVERS``, else from torchrun's store."""
    if servers is None:
        servers = os.environ.get(SERVERS_ENV)
    if isinstance(servers, str):
        servers = [url.strip() for url in servers.split(",") if url.strip()]
    store = _torchrun_store(timeout)
    if servers:
        if store is not None and rank == 0:
            store.set(STORE_KEY, ",".join(servers))  # for ranks started without the list
        return list(servers)
    if store is None:
        raise ValueError(f"no parameter servers: pass servers=, or set ${SERVERS_ENV}, or run under torchrun")
    try:
        published = store.get(STORE_KEY).decode()
    except Exception as exc:  # the store raises its own timeout and connection errors
        raise TensorwireError(
            f"waited {timeout:.3g}s for rank 0 to publish the servers in torchrun's store ({exc})"
        ) from exc
    return str(published).split(",")


def _torchrun_store(timeout: float) -> Any:
    """A client of the store torchrun's agent hosts, when this process runs under torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))  # type: ignore[attr-defined]


def env_int(name: str, given: int | None, default: int) -> int:
    if given is not None:
        return given
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name} must be a whole number, not {raw!r}") from None


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's rank and world size: given, else ``$RANK``/``$WORLD_SIZE`` (set by torchrun
    and by ``tensorwire ps launch``), else 0 and 1; ValueError unless the rank is in the world."""
    rank, world_size = env_int("RANK", rank, 0), env_int("WORLD_SIZE", world_size, 1)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    return rank, world_size


def find_job(
    model: torch.nn.Module,
    servers: Sequence[str] | str | None,
    *,
    timeout: float = 60.0,
    token: str | None = None,
    tls: TlsFiles | None = None,
) -> str:
    """The id of the one job on ``servers`` whose model is ``model`` (its parameters' names,
    shapes and dtypes); ProtocolError if there is none, or several (name one: ``job=``)."""
    digest = model_digest(check_params(model))
    security = client_security(tls, token)
    found: set[str] = set()
    for slot in resolve_servers(servers, 0, timeout):
        for url in slot.split("|"):  # the first replica that answers
            try:
                (doc,) = server_stats([url], timeout=timeout, security=security)
            except TensorwireError:
                continue
            found |= _jobs_of(doc, digest, url)
            break
    if len(found) != 1:
        said = f"jobs {', '.join(sorted(found)[:8])}" if found else "no job"
        raise ProtocolError(f"the servers hold {said} of this model: name the job (job= or ${JOB_ENV})")
    return found.pop()


def _jobs_of(doc: dict[str, object], digest: str, url: str) -> set[str]:
    """The jobs of a server's PS_STATS answer whose model is ``digest``: a peer's JSON, checked
    for its shape (ProtocolError naming the server otherwise) and its ids for being job ids."""
    jobs = doc.get("jobs", {})
    if not isinstance(jobs, dict) or not all(isinstance(s, dict) for s in jobs.values()):
        raise ProtocolError(f"{url} answered PS_STATS with a malformed job list")
    try:
        return {check_job_id(job) for job, summary in jobs.items() if summary.get("model") == digest}
    except ValueError as exc:
        raise ProtocolError(f"{url} listed a bad job id: {exc}") from None
