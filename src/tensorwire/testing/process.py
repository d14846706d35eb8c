"""Real server processes for integration and fault tests: ``tensorwire.server.process``, kept here
as part of the public test kit, and what tests read of a parameter server: its ``ps stats``, its
role (``"gone"`` when it does not answer), the ``ParamServer`` of an in-process server."""

from __future__ import annotations

from typing import Any

from tensorwire.ps import ParamServer
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread
from tensorwire.server.process import ServerProcess, run_threads, wait_for

__all__ = ["ServerProcess", "param_server_of", "ps_role", "ps_stats", "run_threads", "wait_for"]


def ps_stats(url: str, timeout: float = 5.0) -> dict[str, Any]:
    """What the parameter server at ``url`` answers to PS_STATS (``tensorwire ps stats``)."""
    (doc,) = server_stats([url], timeout=timeout)
    return doc


def ps_role(url: str) -> str:
    """Its role (primary, backup, fenced), or ``"gone"``: a stopped or killed process answers
    nothing, and is no primary."""
    try:
        return str(ps_stats(url)["role"])
    except Exception:
        return "gone"


def param_server_of(server: ServerThread) -> ParamServer:
    """The ``ParamServer`` extension of an in-process server."""
    (ps,) = [e for e in server.server.extensions if isinstance(e, ParamServer)]
    return ps
