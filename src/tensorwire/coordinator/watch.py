"""One etcd watch stream on one key: the leader each change leaves, until the stream breaks or the
coordinator is closed.

Every wait is bounded: creating the watch takes at most the connection's timeout; a stream that
stays quiet for ``idle`` seconds is asked for a progress report (etcd 3.4+), which must come within
the timeout, so that a stream to an etcd that vanished without closing its connection breaks
rather than waits for ever. A broken stream raises ``CoordinatorUnavailable``; the caller
(``EtcdCoordinator.watch``) reads the key again and opens a new stream from there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

import grpc
from aetcd import rpc

from tensorwire.coordinator import codec
from tensorwire.coordinator.base import Leader
from tensorwire.coordinator.etcd_rpc import EtcdConnection, Stubs
from tensorwire.errors import CoordinatorUnavailable
from tensorwire.logs import event

log = logging.getLogger("tensorwire.coordinator")
_IDLE = object()  # what a read returns when nothing came within its wait
_DELETE = 1  # mvccpb.Event.EventType.DELETE


async def open_watch(
    conn: EtcdConnection, key: bytes, start_revision: int, idle: float, closed: asyncio.Event
) -> AsyncGenerator[Leader | None, None]:
    """The leader after each change of ``key`` from ``start_revision`` on; ends when ``closed``."""
    what = f"watch of {key[:200].decode('utf-8', 'replace')}"

    async def create(stubs: Stubs, left: float) -> tuple[Stubs, Any]:
        call = stubs.watch.Watch(metadata=stubs.metadata)
        request = rpc.WatchCreateRequest(key=key, start_revision=start_revision)
        await call.write(rpc.WatchRequest(create_request=request))
        return stubs, call

    stubs, call = await conn.call(what, create)
    stream = _Stream(conn, stubs, call, what, closed)
    try:
        while True:
            reply = await stream.next(conn.timeout if stream.created else idle)
            if reply is None:
                return
            for change in _changes(reply, key, what):
                yield change
    finally:
        stream.cancel()


def _changes(reply: Any, key: bytes, what: str) -> list[Leader | None]:
    if reply.canceled or reply.compact_revision:
        reason = str(reply.cancel_reason)[:200]
        raise CoordinatorUnavailable(
            f"etcd canceled the {what} (compacted to {reply.compact_revision}: {reason})"
        )
    changes: list[Leader | None] = []
    for ev in reply.events:
        kv = ev.kv
        if kv.key != key:
            event(log, logging.WARNING, "etcd sent an event for another key", watch=what)
        elif ev.type == _DELETE:
            changes.append(None)
        else:
            changes.append(codec.decode_or_warn(key, kv.value, kv.create_revision, kv.lease))
    return changes


class _Stream:
    """Reads of one watch call, each bounded, a quiet one answered with a progress request."""

    def __init__(
        self, conn: EtcdConnection, stubs: Stubs, call: Any, what: str, closed: asyncio.Event
    ) -> None:
        self._conn = conn
        self._stubs = stubs
        self._call = call
        self._what = what
        self._closed = closed
        self._read: asyncio.Future[Any] | None = None
        self.created = False  # until etcd confirms the watch, a read waits only the timeout

    async def next(self, wait: float) -> Any | None:
        """The next reply, or None once the coordinator is closed."""
        reply = await self._wait(wait)
        if reply is _IDLE and self.created:
            await self._progress()
            reply = await self._wait(self._conn.timeout)
        if reply is _IDLE:
            asked = "confirm the watch" if not self.created else "answer a progress request"
            raise self._conn.unavailable(
                self._what, f"did not {asked} within {self._conn.timeout:.3g}s", self._stubs
            )
        if reply is not None:
            self.created = True
        return reply

    async def _progress(self) -> None:
        try:
            async with asyncio.timeout(self._conn.timeout):
                await self._call.write(rpc.WatchRequest(progress_request=rpc.WatchProgressRequest()))
        except TimeoutError as exc:
            raise self._conn.unavailable(
                self._what, "a progress request could not be sent", self._stubs
            ) from exc
        except grpc.aio.AioRpcError as exc:
            raise self._conn.translate(exc, self._what, self._stubs) from exc

    async def _wait(self, wait: float) -> Any:
        if self._read is None:
            self._read = asyncio.ensure_future(self._call.read())
        stop = asyncio.ensure_future(self._closed.wait())
        try:
            done, _ = await asyncio.wait(
                {self._read, stop}, timeout=wait, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stop.cancel()
        if self._read in done:
            read, self._read = self._read, None
            return self._result(read)
        return None if stop in done else _IDLE

    def _result(self, read: asyncio.Future[Any]) -> Any:
        if read.cancelled():  # the channel was closed under the stream (dropped, or closed)
            if self._closed.is_set():
                return None
            raise self._conn.unavailable(self._what, "the stream's channel was closed", self._stubs)
        exc = read.exception()
        if isinstance(exc, grpc.aio.AioRpcError):
            raise self._conn.translate(exc, self._what, self._stubs) from exc
        if exc is not None:
            raise exc
        reply = read.result()
        if reply is grpc.aio.EOF:
            raise self._conn.unavailable(self._what, "etcd ended the stream", self._stubs)
        return reply

    def cancel(self) -> None:
        if self._read is not None:
            self._read.cancel()
            self._read = None
        self._call.cancel()
