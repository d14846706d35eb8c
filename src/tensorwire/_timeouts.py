"""Finite waits with errors that name what was waited for."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class Deadline:
    """The moment a whole command gives up (``dataset fetch --deadline``, ``status``): per-request
    timeouts alone let a peer that answers each request just in time hold a command for ever."""

    at: float  # time.monotonic()
    what: str  # what gives up, and which flag sets it: "dataset fetch (--deadline 3600s)"

    @classmethod
    def after(cls, seconds: float, what: str) -> Deadline:
        return cls(time.monotonic() + seconds, what)

    def remaining(self) -> float:
        return max(self.at - time.monotonic(), 0.0)

    def expired(self) -> TransferTimeout:
        return TransferTimeout(f"{self.what} ran out of time")

    def check(self) -> None:
        """TransferTimeout if the deadline has passed."""
        if time.monotonic() >= self.at:
            raise self.expired()
