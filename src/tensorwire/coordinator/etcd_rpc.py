"""The one connection to an etcd cluster: a gRPC channel to one endpoint at a time, etcd's auth
token, bounded calls, and the translation of every gRPC failure into a tensorwire error.

It speaks etcd's v3 API through the message classes and stubs that ``aetcd`` generates
(``aetcd.rpc``), on a channel of its own rather than ``aetcd.Client``'s: that client opens only
plaintext channels (no TLS), to one host, fetches its auth token once (etcd's simple tokens expire,
five minutes by default) and leaves deadlines to each caller.

Lifecycle: ``EtcdConnection(...)`` opens nothing; the first ``call`` (or ``open_stream``) opens the
channel, authenticating first when a user is configured. A call that fails on the network drops the
channel, so that the next one opens a fresh channel to the next endpoint. ``close()`` ends it all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from aetcd import rpc

from tensorwire.coordinator.url import Endpoint
from tensorwire.errors import (
    AuthenticationError,
    CertificateRefused,
    CoordinatorUnavailable,
    NotAuthorized,
    TensorwireError,
)
from tensorwire.logs import event
from tensorwire.security import TlsFiles, grpc_channel_credentials

log = logging.getLogger("tensorwire.coordinator")
T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]

# etcd refuses requests over 1.5 MiB by default, so that no value it hands back is larger; this
# bounds what one answer may cost us if it was configured otherwise.
MAX_RECEIVE = 4 * 1024 * 1024
_DETAILS = 200  # characters of an error's details (etcd's, or a peer's) quoted in a message
_TOKEN_EXPIRED = "invalid auth token"
_MAX_TOKEN = 4096  # etcd's simple tokens are 16 letters and a number; JWTs a few hundred bytes
_REFUSED = ("authentication failed", "user name is empty")  # INVALID_ARGUMENT, for etcd 3.4
_TLS_FAILURE = ("handshake", "ssl", "certificate")


@dataclass(frozen=True, slots=True)
class Stubs:
    """The etcd services on one channel, and the metadata (auth token) every call carries."""

    kv: Any
    lease: Any
    watch: Any
    metadata: Metadata
    endpoint: Endpoint


class EtcdConnection:
    """Bounded calls to etcd (see the module docstring for the lifecycle)."""

    def __init__(
        self,
        endpoints: tuple[Endpoint, ...],
        *,
        tls: TlsFiles | None,
        user: str | None,
        password: str | None,
        timeout: float,
    ) -> None:
        if (user is None) != (password is None):
            raise ValueError("etcd authentication needs both a user and a password")
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = endpoints
        self.timeout = timeout
        self._credentials = grpc_channel_credentials(tls) if tls is not None else None
        self._user = (user, password) if user is not None and password is not None else None
        self._next = 0
        self._channel: grpc.aio.Channel | None = None
        self._stubs: Stubs | None = None
        self._opening = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        self.closed = False

    async def call(
        self, what: str, op: Callable[[Stubs, float], Awaitable[T]], timeout: float | None = None
    ) -> T:
        """``op(stubs, seconds_left)`` within ``timeout`` (the connection's by default), with an
        expired auth token renewed once; every failure a tensorwire error naming ``what``."""
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        for renew_token in (True, False):
            stubs: Stubs | None = None
            try:
                async with asyncio.timeout(budget):
                    stubs = await self.stubs(budget)
                    return await op(stubs, max(deadline - time.monotonic(), 0.001))
            except TimeoutError as exc:
                self.drop(stubs)
                raise self.unavailable(what, f"no answer within {budget:.3g}s", stubs) from exc
            except grpc.aio.AioRpcError as exc:
                if renew_token and self._user is not None and _TOKEN_EXPIRED in (exc.details() or ""):
                    self.drop(stubs)  # etcd forgot the token (it expired, or etcd restarted)
                    continue
                raise self.translate(exc, what, stubs) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def stubs(self, timeout: float) -> Stubs:
        """The stubs of the open channel, opening one (and authenticating) if there is none."""
        if self.closed:
            raise CoordinatorUnavailable("the coordinator was closed")
        async with self._opening:
            if self._stubs is None:
                self._stubs = await self._open(timeout)
            return self._stubs

    async def _open(self, timeout: float) -> Stubs:
        endpoint = self.endpoints[self._next % len(self.endpoints)]
        options = [
            ("grpc.max_receive_message_length", MAX_RECEIVE),
            # After etcd comes back, reconnect within a second rather than gRPC's default backoff
            # (up to two minutes).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(endpoint.target, options=options)
        else:
            channel = grpc.aio.secure_channel(endpoint.target, self._credentials, options=options)
        self._channel = channel
        metadata: Metadata = ()
        if self._user is not None:
            name, password = self._user
            request = rpc.AuthenticateRequest(name=name, password=password)
            reply = await rpc.AuthStub(channel).Authenticate(request, timeout=timeout)
            metadata = (("token", _checked_token(reply.token, endpoint)),)
        return Stubs(rpc.KVStub(channel), rpc.LeaseStub(channel), rpc.WatchStub(channel), metadata, endpoint)

    def drop(self, stubs: Stubs | None) -> None:
        """Forget the channel ``stubs`` came from (if it is still the open one): the next call opens
        a fresh one, to the next endpoint. Calls still running on it get a grace period."""
        if self._channel is None or (stubs is not None and stubs is not self._stubs):
            return
        channel, self._channel, self._stubs = self._channel, None, None
        self._next += 1
        task = asyncio.get_running_loop().create_task(channel.close(grace=self.timeout))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def unavailable(self, what: str, why: str, stubs: Stubs | None) -> CoordinatorUnavailable:
        where = stubs.endpoint.target if stubs is not None else self._current_target()
        return CoordinatorUnavailable(f"etcd at {where}: {what}: {why}")

    def translate(self, exc: grpc.aio.AioRpcError, what: str, stubs: Stubs | None) -> TensorwireError:
        """The tensorwire error for a failed gRPC call (foreign exceptions stop at this boundary)."""
        code = exc.code()
        details = (exc.details() or "")[:_DETAILS]
        where = stubs.endpoint.target if stubs is not None else self._current_target()
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return NotAuthorized(f"etcd at {where} refused {what}: {details}")
        if code == grpc.StatusCode.UNAUTHENTICATED or any(text in details for text in _REFUSED):
            return AuthenticationError(f"etcd at {where} refused the credentials ({what}): {details}")
        if code == grpc.StatusCode.FAILED_PRECONDITION and "authentication is not enabled" in details:
            return AuthenticationError(f"etcd at {where} has no authentication, but a user was given")
        if code == grpc.StatusCode.UNAVAILABLE and self._credentials is not None and _tls_failed(exc):
            return CertificateRefused(f"TLS with etcd at {where} failed ({what}): {details}")
        self.drop(stubs)
        return CoordinatorUnavailable(f"etcd at {where}: {what} failed with {code.name}: {details}")

    async def close(self) -> None:
        self.closed = True
        channel, self._channel, self._stubs = self._channel, None, None
        if channel is not None:
            await channel.close(grace=None)
        for task in list(self._retiring):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await task

    def _current_target(self) -> str:
        return self.endpoints[self._next % len(self.endpoints)].target


def _checked_token(token: object, endpoint: Endpoint) -> str:
    # Sent back as gRPC metadata on every call: what gRPC would refuse there (or a token that
    # makes every request large) is refused here, once, as etcd's fault.
    if isinstance(token, str) and 0 < len(token) <= _MAX_TOKEN and token.isascii() and token.isprintable():
        return token
    raise AuthenticationError(f"etcd at {endpoint.target} answered authentication with an unusable token")


def _tls_failed(exc: grpc.aio.AioRpcError) -> bool:
    text = f"{exc.details()} {exc.debug_error_string()}".lower()
    return any(word in text for word in _TLS_FAILURE)


def log_ignored(what: str, exc: BaseException) -> None:
    event(log, logging.WARNING, "coordinator call failed; carrying on", call=what, error=str(exc))
