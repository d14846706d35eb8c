"""A request's outcome on the client's side of the frame protocol: where its answer goes
(``Pending``, settled by a ``Settles``), and the plain functions that settle it from an answer,
shared by the multiplexer's coroutines (frame_mux.py) and a borrowing thread's plain calls
(``FrameMux.read_frame_now``, for lending.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tensorwire.errors import (
    ConnectionLost,
    CorruptFrame,
    InvalidTensor,
    ProtocolError,
    TensorwireError,
    error_for_code,
)
from tensorwire.transport.base import Sink
from tensorwire.transport.whole import copy_chunk
from tensorwire.types import Address, Limits
from tensorwire.wire import meta as wm
from tensorwire.wire.frame import Header

Answer = tuple[Header, wm.MetaReader]

# What a client accepts from a server: generous, but every length is still bounded.
CLIENT_LIMITS = Limits(max_meta_bytes=256 << 20, max_batch=10_000_000, max_request_bytes=1 << 50)


class Settles(Protocol):
    """Where a request's answer goes: an ``asyncio.Future``, or a borrower's ``lending.Outcome``."""

    def done(self) -> bool: ...

    def set_result(self, result: Any) -> None: ...

    def set_exception(self, error: BaseException) -> None: ...


@dataclass(slots=True)
class Pending:
    """A request waiting for its answer."""

    opcode: int
    future: Settles  # settled by whoever reads the answer
    wait: float  # seconds it may take, its send included
    deadline: float  # the loop time those seconds end at (0: a borrower's, timed by its stream)
    what: str
    sink: Sink | None = None
    progress: Callable[[int], None] | None = None


def check_opcode(header: Header, pending: Pending | None, address: Address) -> None:
    """ProtocolError if ``header`` answers ``pending`` with another request's opcode."""
    if pending is not None and header.opcode not in (pending.opcode, 0):
        raise ProtocolError(f"{address} answered request {header.request_id} with another opcode")


def refused(header: Header, reader: wm.MetaReader, pending: Pending | None) -> None:
    """An error frame: it fails its request, or every request if it answers none (id 0)."""
    code, message = wm.decode_error(reader)
    if pending is None and header.request_id == 0:
        raise error_for_code(code, message)  # a connection-level error: fail everything
    settle(pending, error=error_for_code(code, message))


def as_tensorwire(
    exc: BaseException, what: str, kind: type[TensorwireError] = InvalidTensor
) -> TensorwireError:
    """``exc`` as a ``TensorwireError`` (``kind``, naming ``what`` failed, if it is not one)."""
    if isinstance(exc, TensorwireError):
        return exc
    error = kind(f"{what} failed: {exc!r}")
    error.__cause__ = exc
    return error


def landing(header: Header, meta: bytes, pending: Pending) -> tuple[wm.MetaReader, list[memoryview]] | None:
    """Where a GET answer's data lands: its records, checked (their sizes before the sink
    allocates anything), and the sink's buffers for them; None if it refused them (the request is
    failed then, and the data must be skipped)."""
    probe = wm.MetaReader(meta, CLIENT_LIMITS)
    try:
        assert pending.sink is not None
        metas = wm.decode_records(probe)
        if sum(m.nbytes for m in metas) != header.data_len:
            raise ProtocolError("response data length does not match its tensor records")
        return probe, pending.sink(metas)
    except Exception as exc:
        settle(pending, error=as_tensorwire(exc, "landing the answer"))
        return None


def land_now(header: Header, meta: bytes, pending: Pending, data: memoryview) -> None:
    """A GET answer's one chunk (``data``: its bytes and trailer, in the read buffer) checked, then
    copied to where the sink says: a corrupt chunk never reaches the caller's tensors."""
    landed = landing(header, meta, pending)
    if landed is None:
        return
    probe, buffers = landed
    try:
        copy_chunk(header, data, buffers)
    except CorruptFrame as exc:
        settle(pending, error=exc)
        return
    settle(pending, result=(header, probe))


def lost_mid_answer(pending: Pending | None, exc: BaseException, address: Address) -> None:
    """A claimed request whose answer broke off fails at once, not when its timer runs out."""
    lost = ConnectionLost(f"the connection to {address} failed mid-answer: {exc!r}")
    settle(pending, error=exc if isinstance(exc, TensorwireError) else lost)


def drop_outcome(future: asyncio.Future[Answer]) -> None:
    """Mark the outcome of a request nobody will await as heard (no "exception was never
    retrieved" log when the future is collected)."""
    if future.done() and not future.cancelled():
        future.exception()


def settle(pending: Pending | None, result: Answer | None = None, error: BaseException | None = None) -> None:
    if pending is None or pending.future.done():
        return
    if error is not None:
        pending.future.set_exception(error)
    else:
        assert result is not None
        pending.future.set_result(result)
