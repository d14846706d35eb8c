"""The blocking client's plain gets and puts, made in the caller's own thread on a lent connection
(transport/lending.py): no event-loop turn and no thread hop, the two wake-ups that cost a small
blocking call more than its bytes and the server together. All of the path's client side is here;
``Client.get`` and ``Client.put`` (blocking.py) try it first.

Which calls: a get into a CPU tensor (or a new one) or a put of a CPU tensor, with no progress
callback, that takes the PLAIN route (``routes.Routes``: the question the async client asks too),
with no cache, on a ``Lendable`` connection the loop has lent. The loop lends it after such a call
made through it (``on_loop``), and takes it back before it runs anything else (``reclaim``).

What comes back is the call's result, or ``ToLoop``: make the call through the loop instead, with
the attempts made here already counted against its retries. A call that finds the connection not
lent (another thread has it, or it was taken back), or closed by the server while lent (the loop
reopens it), made no attempt. One that failed with a retryable error (a broken connection, a
timeout, a corrupt chunk) made one: the loop makes the retries the options leave, on a connection
the loan's end dropped if it broke; with no retries the error is raised here, as is one no retry
cures (KeyNotFound, a wrong ``out``).

The path's invariant: **nothing on it may wait on the event loop.** It runs in the caller's thread:
a small get or put with plain calls only (``Lendable.get_now``, ``put_now``: no coroutine at all,
about a tenth less CPU than stepping them), a larger one stepping the transport's coroutines itself
(``_aio.drive``): a bare yield is a turn given to nobody, but an ``await`` of a future would wait
for the loop's thread, which is not running this coroutine and would never settle it. ``drive``
stops such a call (``WouldWait``); the lending half turns that into ConnectionLost ("outside its
loop"), drops the connection and logs a warning, and the call goes to the loop (tests/integration/
test_inline_calls.py holds a test that fails if this guard goes). So: no locks of asyncio, no
``run_in_executor``, no sleeps but ``asyncio.sleep(0)`` anywhere under a plain get or put of a
lendable transport.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from tensorwire.client.async_client import AsyncClient
from tensorwire.client.batches import Landing, TensorBatch
from tensorwire.client.routes import Route
from tensorwire.errors import TensorwireError
from tensorwire.transport.base import Transport
from tensorwire.transport.lending import Lendable, NotLent

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ToLoop:
    """Not made here: make the call through the loop, ``attempts`` of it made here already."""

    attempts: int


NOT_TAKEN = ToLoop(0)


def get(client: AsyncClient, name: str, out: torch.Tensor | None, timeout: float) -> torch.Tensor | ToLoop:
    """``client.get(name, out)`` made in this thread, or ToLoop."""
    if out is not None and not out.is_cpu:
        return NOT_TAKEN
    t = _lent(client)
    if t is None or client.routes.get(t, name, out) is not Route.PLAIN:
        return NOT_TAKEN
    landing = Landing([name], {name: out} if out is not None else {})
    got = _run(client, cast(Lendable, t).get_now, [name], landing.sink, timeout)
    if isinstance(got, ToLoop):
        return got
    tensor = landing.finish()[name]
    client.routes.moved(name, tensor.numel() * tensor.element_size())
    return tensor


def put(client: AsyncClient, name: str, tensor: torch.Tensor, timeout: float) -> int | ToLoop:
    """``client.put(name, tensor)`` made in this thread, or ToLoop."""
    if not tensor.is_cpu:
        return NOT_TAKEN
    nbytes = tensor.numel() * tensor.element_size()
    t = _lent(client)
    if t is None or client.routes.put(t, nbytes, cuda=False) is not Route.PLAIN:
        return NOT_TAKEN
    batch = TensorBatch([(name, tensor)])  # an invalid name or tensor is refused here, as there
    version = _run(client, cast(Lendable, t).put_now, batch, timeout)
    if not isinstance(version, ToLoop):
        client.routes.moved(name, nbytes)
    return version


def _lent(client: AsyncClient) -> Transport | None:
    """The client's open connection if it is ``Lendable`` and no cache stands in front of it."""
    t = client.current_transport
    if t is None or t.closed or client.cache.enabled or not _lendable(t):
        return None
    return t


def _lendable(t: Transport) -> bool:
    """Whether ``t`` is ``Lendable``, asked once per class (a Protocol's isinstance walks all its
    members: a tenth of a small call's time)."""
    kind = type(t)
    can = _LENDABLE.get(kind)
    if can is None:
        can = _LENDABLE[kind] = isinstance(t, Lendable)
    return can


_LENDABLE: dict[type, bool] = {}


def _run(client: AsyncClient, call: Callable[..., T | NotLent], *args: Any) -> T | ToLoop:
    """``call(*args, spin)`` (a lent connection's ``get_now`` or ``put_now``), or ToLoop."""
    try:
        done = call(*args, client.options.busy_wait)
    except TensorwireError as exc:
        if exc.retryable and client.options.retries > 0:
            return ToLoop(1)  # the loop retries; the loan's end drops a broken connection
        raise
    return NOT_TAKEN if isinstance(done, NotLent) else done


async def on_loop(client: AsyncClient, coro: Coroutine[Any, Any, T], lend: bool) -> T:
    """A call made through the client's loop: the connection is taken back first, if lent (the
    loop's requests and a borrower's must not interleave, and a connection the server closed while
    lent is seen closed before the call picks one), and after a call that could have been made
    inline (``lend``) it is lent again for the next one (not with a cache: no get would be inline,
    and the cache asks an idle connection whether the server dropped it)."""
    t = client.current_transport
    try:
        if t is not None and _lendable(t):
            await cast(Lendable, t).reclaim()
    except BaseException:
        coro.close()
        raise
    result = await coro
    now = (
        client.current_transport if lend and not client.cache.enabled else None
    )  # a retry may have opened another
    if now is not None and _lendable(now):
        cast(Lendable, now).lend()
    return result
