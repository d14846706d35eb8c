"""Finite waits with errors that name what was waited for."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from tensorwire.errors import TransferTimeout


@contextlib.asynccontextmanager
async def asyncio_timeout(seconds: float, what: str) -> AsyncIterator[None]:
    """Like ``asyncio.timeout`` but raises TransferTimeout("waited Ns for <what>")."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError as exc:
        if isinstance(exc, TransferTimeout):
            raise
        raise TransferTimeout(f"waited {seconds:.3g}s for {what}") from exc
