"""The blocking client's plain gets and puts, made in the caller's own thread on a lent connection
(transport/lending.py): no event-loop turn and no thread hop, the two wake-ups that cost a small
blocking call more than its bytes and the server together.

Which calls: a get into a CPU tensor (or a new one) or a put of a CPU tensor, with no progress
callback, that would be one plain request anyway (no cache, no stripes, no resumable put: the
async client says, ``plain_connection``), on a ``Lendable`` connection the loop has lent. The loop
lends it after such a call made through it (``lend``), and takes it back before it runs anything
else (``reclaim``). A call that finds it not lent (another thread has it, or it was taken back)
goes through the loop as before, and so does one on a connection the server closed while it was
lent (the loop reopens it, as it would have on noticing the close). A call that failed with a
retryable error (a broken connection, a timeout, a corrupt chunk) made its first attempt: the
loop makes the retries the options leave (``Fallback.attempts``, ``retry.PRIOR_ATTEMPTS``), on a
connection the loan's end dropped if it broke; with no retries the error is raised here, as is
one no retry cures (KeyNotFound, a wrong ``out``).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, cast

import torch

from tensorwire.client.async_client import AsyncClient
from tensorwire.client.batches import Landing, TensorBatch
from tensorwire.client.retry import PRIOR_ATTEMPTS
from tensorwire.errors import TensorwireError
from tensorwire.transport.base import Lendable, Transport
from tensorwire.transport.lending import NotLent


class Fallback(Exception):
    """Make the call through the loop instead, ``attempts`` of it made here already (0 or 1)."""

    def __init__(self, attempts: int) -> None:
        super().__init__(attempts)
        self.attempts = attempts


def get(client: AsyncClient, name: str, out: torch.Tensor | None, timeout: float) -> torch.Tensor:
    """``client.get(name, out)`` made in this thread; Fallback: make it through the loop."""
    if out is not None and not out.is_cpu:
        raise Fallback(0)
    nbytes = out.numel() * out.element_size() if out is not None else None
    landing = Landing([name], {name: out} if out is not None else {})

    async def op(t: Transport) -> None:
        await t.get([name], landing.sink)

    _run(client, _lendable(client.plain_connection(name, nbytes, put=False)), op, timeout)
    tensor = landing.finish()[name]
    client.note_size(name, tensor.numel() * tensor.element_size())
    return tensor


def put(client: AsyncClient, name: str, tensor: torch.Tensor, timeout: float) -> int:
    """``client.put(name, tensor)`` made in this thread; Fallback: make it through the loop."""
    if not tensor.is_cpu:
        raise Fallback(0)
    nbytes = tensor.numel() * tensor.element_size()
    t = _lendable(client.plain_connection(name, nbytes, put=True))
    if t is None:
        raise Fallback(0)
    batch = TensorBatch([(name, tensor)])  # an invalid name or tensor is refused here, as there
    versions: list[int] = []

    async def op(t: Transport) -> None:
        versions.append(await t.put(batch))

    _run(client, t, op, timeout)
    client.note_size(name, nbytes)
    return versions[0]


def _lendable(t: object) -> Lendable | None:
    """``t`` if it is ``Lendable``, asked once per class (a Protocol's isinstance walks all its
    members: a tenth of a small call's time)."""
    if t is None:
        return None
    kind = type(t)
    can = _LENDABLE.get(kind)
    if can is None:
        can = _LENDABLE[kind] = isinstance(t, Lendable)
    return cast(Lendable, t) if can else None


_LENDABLE: dict[type, bool] = {}


def _run(client: AsyncClient, t: Lendable | None, op: Any, timeout: float) -> None:
    """``op`` run to its end on ``t`` in this thread; Fallback to make the call on the loop."""
    if t is None:
        raise Fallback(0)
    try:
        t.run_inline(op, timeout, client.options.busy_wait)
    except NotLent:
        raise Fallback(0) from None
    except TensorwireError as exc:
        if exc.retryable and client.options.retries > 0:
            raise Fallback(1) from exc  # the loop retries; the loan's end drops a broken connection
        raise


async def on_loop(client: AsyncClient, coro: Coroutine[Any, Any, Any], lend: bool, attempts: int) -> Any:
    """A call made through the client's loop: the connection is taken back first, if lent (the
    loop's requests and a borrower's must not interleave), and ``attempts`` already made count
    against its retries; after a call that could have been made inline (``lend``), the connection
    is lent again for the next one (not with a cache: no get would be inline, and the cache asks
    an idle connection whether the server dropped it)."""
    PRIOR_ATTEMPTS.set(attempts)  # this task's own context: no other call sees it
    t = _lendable(client.current_transport)
    try:
        if t is not None:
            await t.reclaim()
    except BaseException:
        coro.close()
        raise
    result = await coro
    lend = lend and not client.cache.enabled
    now = _lendable(client.current_transport) if lend else None  # a retry may have opened another
    if now is not None:
        now.lend()
    return result
