"""What the rdma:// tests share: why they cannot run here (printed as the skip reason), and the
switch to the engine's TCP mode (no RDMA device on a development machine or in CI)."""

from __future__ import annotations

import functools

from tensorwire.errors import RdmaUnavailable
from tensorwire.transport import rdma_engine

TCP_MODE = {rdma_engine.PROTOCOL_ENV: "tcp"}


@functools.cache
def unavailable() -> str | None:
    """Why the transfer engine cannot load on this machine (the wheel or libibverbs1 missing), or
    None when it can."""
    try:
        rdma_engine.load()
    except RdmaUnavailable as exc:
        return str(exc)
    return None
