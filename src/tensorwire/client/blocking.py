"""``Client``: the blocking client (``tensorwire.connect(url)``). Each method runs the ``AsyncClient``
method of the same name on a private event-loop thread and waits for it, never longer than the
options' worst case (nor past their ``deadline``); a plain get or put is made in the caller's own
thread instead, where the connection allows (client/inline.py)."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Coroutine, Mapping, Sequence, Sized
from typing import Any, TypeVar

import torch

from tensorwire._aio import LoopThread
from tensorwire._gc import gc_paused
from tensorwire.client import inline
from tensorwire.client.async_client import AsyncClient, Progress, TensorItems
from tensorwire.client.deltas import DeltaStats
from tensorwire.client.generations import DEFAULT_LEASE_SECONDS, At, Lease
from tensorwire.client.options import ClientOptions
from tensorwire.client.ranges import GenerationRead
from tensorwire.errors import ConnectError, TensorwireError, TransferTimeout
from tensorwire.types import Generation, GenerationManifest, TensorMeta

T = TypeVar("T")


class Client:
    """The blocking client: each method runs the ``AsyncClient`` method of the same name on a
    private event loop thread and waits for it (never longer than the options' worst case)."""

    def __init__(self, url: str, options: ClientOptions | None = None) -> None:
        self._worst_case = (options or ClientOptions()).worst_case
        self._deadline = (options or ClientOptions()).deadline
        self._url = url
        self._forks = _forks[0]  # a forked child must never drive its parent's socket (inline.py)
        self._thread = LoopThread("tensorwire-client")
        self._loop = self._thread.loop
        try:
            self._async = self._thread.call(_make_async(url, options), self._worst_case, f"a client of {url}")
        except BaseException:
            self._stop()
            raise
        # A client dropped without close(), or still open at exit, closes its connection (its read
        # loop ends) and stops its loop all the same: nothing is left pending to be destroyed.
        self._finalizer = weakref.finalize(self, _shut, self._thread, self._async, os.getpid())

    @property
    def transport(self) -> str:
        return self._async.transport

    @property
    def local_fallback(self) -> str | None:
        return self._async.local_fallback

    @property
    def url(self) -> str:
        return self._async.url

    @property
    def options(self) -> ClientOptions:
        return self._async.options

    @property
    def resumed_at(self) -> list[int]:
        return self._async.resumed_at

    @property
    def delta_stats(self) -> DeltaStats:
        return self._async.delta_stats

    @property
    def segment_bytes(self) -> int:
        return self._async.segment_bytes

    def _call(self, coro: Coroutine[Any, Any, T], longer: float = 0.0, *, lend: bool = False) -> T:
        # The worst case is a backstop: the client's own timers should have fired long before.
        # ``longer``: a call that waits on purpose (``wait``) may take that much more. ``lend``: a
        # call the caller's thread could have made itself: the connection is lent after it.
        worst = self._worst_case + longer
        deadline = self._deadline
        if not self._finalizer.alive:  # closed, or closing under a call from another thread
            coro.close()
            raise ConnectError(f"client of {self._url} is closed")
        if deadline is not None and deadline.remaining() <= 0:
            coro.close()
            raise deadline.expired()
        coro = inline.on_loop(self._async, coro, lend)
        if deadline is None:
            return self._thread.call(coro, worst, f"a call to {self._url}")
        try:  # cut short at the deadline: the call is cancelled, and its connection dropped
            return self._thread.call(coro, min(worst, deadline.remaining()), f"a call to {self._url}")
        except TransferTimeout as exc:
            if deadline.remaining() > 0:
                raise
            raise deadline.expired() from exc

    def _inline_timeout(self) -> float | None:
        """How long a request made in the caller's thread may take (the deadline's remainder; inf:
        the transport's own timeout); None: not from this process (a fork's copy of the client)."""
        if _forks[0] != self._forks:
            return None
        if self._deadline is None:
            return float("inf")
        left = self._deadline.remaining()
        if left <= 0:
            raise self._deadline.expired()
        return left

    def connect(self) -> Client:
        self._call(self._async.connect())
        return self

    def put(self, name: str, tensor: torch.Tensor, progress: Progress | None = None) -> int:
        attempts = 0
        if progress is None and (timeout := self._inline_timeout()) is not None:
            made = inline.put(self._async, name, tensor, timeout)  # in this thread, if it can be
            if not isinstance(made, inline.ToLoop):
                return made
            attempts = made.attempts
        coro = self._async.put(name, tensor, progress, attempts=attempts)
        return self._call(coro, lend=progress is None)

    def put_many(self, items: TensorItems, progress: Progress | None = None) -> int:
        with _batch(items):
            return self._call(self._async.put_many(items, progress))

    def get(
        self,
        name: str,
        out: torch.Tensor | None = None,
        progress: Progress | None = None,
        *,
        view: bool = False,
        at: At | None = None,
        verify: bool = False,
        base: At | None = None,
    ) -> torch.Tensor:
        plain = progress is None and not view and at is None and not verify and base is None
        attempts = 0
        if plain and (timeout := self._inline_timeout()) is not None:
            got = inline.get(self._async, name, out, timeout)  # in this thread, if it can be
            if not isinstance(got, inline.ToLoop):
                return got
            attempts = got.attempts
        coro = self._async.get(
            name, out, progress, view=view, at=at, verify=verify, base=base, attempts=attempts
        )
        return self._call(coro, lend=plain)

    def get_many(
        self,
        names: Sequence[str],
        out: Mapping[str, torch.Tensor] | None = None,
        progress: Progress | None = None,
        *,
        at: At | None = None,
        verify: bool = False,
        base: At | None = None,
    ) -> dict[str, torch.Tensor]:
        """``AsyncClient.get_many`` (``base=``: a delta read into ``out``)."""
        with _batch(names):
            return self._call(self._async.get_many(names, out, progress, at=at, verify=verify, base=base))

    # -- generations (AsyncClient's methods of the same names) ----------------------------------
    def publish(
        self, prefix: str, tensors: Mapping[str, torch.Tensor], progress: Progress | None = None
    ) -> Generation:
        return self._call(self._async.publish(prefix, tensors, progress))

    def publish_part(
        self,
        prefix: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        txn: bytes,
        index: int,
        count: int,
        timeout: float,
    ) -> Generation:
        coro = self._async.publish_part(prefix, tensors, txn=txn, index=index, count=count, timeout=timeout)
        return self._call(coro, longer=timeout)

    def read_generation(self, prefix: str, at: At = "latest") -> GenerationRead:
        return GenerationRead(self._call(self._async.read_generation(prefix, at)), self._call)

    def get_range(
        self, name: str, *, at: At, offset: int, length: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._call(self._async.get_range(name, at=at, offset=offset, length=length, out=out))

    def manifest(self, prefix: str, at: At = "latest") -> GenerationManifest:
        return self._call(self._async.manifest(prefix, at))

    def wait(self, prefix: str, after: int = 0, *, timeout: float) -> Generation:
        return self._call(self._async.wait(prefix, after, timeout=timeout), longer=timeout)

    def lease(self, prefix: str, number: int, seconds: float = DEFAULT_LEASE_SECONDS) -> Lease:
        return Lease(self._call(self._async.lease(prefix, number, seconds)), self._call)

    def drop_generations(self, prefix: str) -> int:
        return self._call(self._async.drop_generations(prefix))

    def delete(self, name: str) -> None:
        self._call(self._async.delete(name))

    def delete_many(self, names: Sequence[str]) -> int:
        return self._call(self._async.delete_many(names))

    def stat(self, name: str) -> TensorMeta:
        return self._call(self._async.stat(name))

    def list(self, prefix: str = "", limit: int = 0) -> list[TensorMeta]:
        return self._call(self._async.list(prefix, limit))

    def ping(self) -> float:
        return self._call(self._async.ping())

    def close(self) -> None:
        """Close the connection and stop the client's loop (once; later calls do nothing)."""
        self._finalizer()

    def _stop(self) -> None:
        self._thread.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Forks this process has come from; os.getpid() would cost a syscall on every inline call.
_forks = [0]
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))

CLOSE_TIMEOUT = 10.0  # closing cancels the read loop and closes a socket: it takes milliseconds


def _shut(thread: LoopThread, client: AsyncClient, pid: int) -> None:
    """``Client.close``, also run when a client is garbage or the interpreter exits (finalize)."""
    if os.getpid() != pid or thread.loop.is_closed():
        return  # a forked child: the loop's thread exists only in the parent
    if thread.on_loop():  # dropped by code running on its own loop: close there, then stop it
        task = thread.loop.create_task(client.close())
        task.add_done_callback(lambda _: thread.loop.stop())
        return
    try:
        with contextlib.suppress(TensorwireError):  # a broken connection closes all the same
            thread.call(client.close(), CLOSE_TIMEOUT, f"closing the client of {client.url}")
    finally:
        thread.stop()


async def _make_async(url: str, options: ClientOptions | None) -> AsyncClient:
    return AsyncClient(url, options)  # built on the client's loop: its locks belong to that loop


def _batch(items: object) -> contextlib.AbstractContextManager[None]:
    """Around a batch call of many tensors: the cyclic collector paused until it returns.

    Its records, views and buffers (a few objects per tensor) live until the call ends, so a
    collection mid-call walks and promotes all of them, and the growth of the old generation that
    leaves behind brings on full collections: with 10,000 tensors about a third of the client's CPU
    per tensor. Paused, they are freed by reference counting before the collector counts them. The
    pause is the process's, for as long as the call takes (its timeout at most): cycles other
    threads make meanwhile wait for the next collection, nothing else does."""
    many = isinstance(items, Sized) and len(items) >= _PAUSE_AT  # (an iterator: not paused)
    return gc_paused() if many else contextlib.nullcontext()


_PAUSE_AT = 1024  # tensors: from about here a batch's own objects bring on collections
