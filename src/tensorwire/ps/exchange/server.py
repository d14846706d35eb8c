"""Gradient exchange: the average of N data-parallel workers' gradients, per step and tensor.

For training code that keeps its optimizer local and wants an ``allreduce`` of its gradients
without ``torch.distributed``: each worker sends its gradient for (step, tensor name) and gets
back the mean over the live workers of that step, once every one of them has sent. The sum runs in
worker order, so every worker gets bit-identical numbers and a rerun gives the same ones.

Served two ways by every parameter server (``tensorwire ps serve``):

* the frame protocol's ``ALLREDUCE`` (many tensors of one step in one request), which
  ``ExchangeClient`` speaks over tcp://, tls:// and memory://;
* gRPC ``train.GradientService/UpdateGradient`` (proto/tensorwire/v1/gradient_service.proto,
  served by ``rpc.py``), which any client generated from that schema speaks: float32 bytes in and
  out, the worker id, step, tensor name (and optionally the world size) in call metadata. A call
  with none of them is a one-worker exchange when the server's world is 1 (``--workers``, the
  default): its answer is its own gradient, which is what a training loop written for one
  worker expects.

Either way a worker may send its gradient compressed (tensorwire.compression): ALLREDUCE names
the codec after its records, gRPC callers add ``codec`` and ``numel`` to the call metadata. The
server decodes each gradient once, on arrival, in a worker thread; the means go back in full
precision (float32 on gRPC), so every worker still gets the same bits.

What a peer can make the exchange hold is bounded by its ``capacity`` and, once it serves in a
server process (``attach``), by that process's one ``--capacity`` (the tensor store's ledger, where
it counts as ``exchange`` beside the store's tensors and the parameter server's jobs), checked
before anything is allocated: the decoded size of every gradient (a compressed one declares its
element count, and may decode to 32 times its payload), the payloads while they are decoded, a
round's mean until every contributor's answer is sent, and a fixed cost per open round and per
tensor name remembered as averaged, so that empty gradients under fresh names or steps cannot
grow the tables for free. Open rounds expire with their callers' waits. Who a
request says it is (rank, world size, step) is checked before anything changes.

A rank belongs to the client that last sent under it (its session: the random number an
``ExchangeClient`` sends in ``seq``; for a gRPC call, its ``session`` call metadata; else the host
it comes from, which keeps other hosts out but not another process on the same host). Gradients
or a leave under that rank from another session are refused before they change anything, until
the owner leaves or has been silent for twice the wait timeout (a restarted worker takes its rank
back then): without it, anyone could send a gradient under another worker's rank, and the real
worker's would be refused as a second one for that step.

"Live": a worker that leaves (``PS_LEAVE``, sent by ``ExchangeClient.close``) no longer counts,
so workers with uneven amounts of data finish without waiting for each other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from tensorwire._aio import within
from tensorwire.compression.codecs import Codec, decode_all, from_wire, payload_total
from tensorwire.errors import (
    CapacityExceeded,
    InvalidTensor,
    ProtocolError,
    WaitTimeout,
)
from tensorwire.logs import event
from tensorwire.ps.budget import Ledger
from tensorwire.server.core import Request
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.names import validate_name
from tensorwire.wire.tensors import byte_view, empty_for

log = logging.getLogger("tensorwire.ps.exchange_server")
MAX_WORLD = 1 << 16
# What an open round and a remembered tensor name cost against the capacity besides gradient
# bytes: about what their Python objects take (a round's future, dict and key; a dict entry).
ROUND_COST = 1024
NAME_COST = 256
LEDGER_KIND = "exchange"  # what the exchange holds, in the store's one ledger


@dataclass(eq=False)
class _Owner:
    """The session a rank belongs to, and when it last sent under it."""

    session: Hashable
    seen: float


@dataclass(eq=False)
class _Round:
    """One (step, tensor) being averaged."""

    world: int
    cost: int
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    settled: bool = False  # its mean is being taken: nobody can join or leave it any more
    # Contributors not yet answered from its mean, and the mean's bytes, which stay counted until
    # the last of them has sent its answer (a peer that reads slowly holds the mean meanwhile).
    answers: int = 0
    mean_bytes: int = 0
    result: asyncio.Future[tuple[torch.Tensor, int]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class GradientExchange:
    """The server side: rounds keyed by (step, tensor name); see the module doc."""

    def __init__(self, workers: int = 1, wait_timeout: float = 120.0, capacity: int = 1 << 62) -> None:
        self.default_world = workers  # for gRPC callers that send no world-size (0: they must)
        self.wait_timeout = wait_timeout
        self.capacity = capacity  # most bytes open rounds and the exchange's tables may hold
        self.held = 0
        self._ledger: Ledger | None = None  # the process's one capacity (``attach``)
        self.left: set[int] = set()
        self.rounds_done = 0
        self._rounds: dict[tuple[int, str], _Round] = {}
        self._done: dict[str, int] = {}  # the last step averaged, per tensor
        self._last_world = 0
        self._means: set[asyncio.Task[torch.Tensor]] = set()  # means being taken (kept from the GC)
        self._owners: dict[int, _Owner] = {}  # rank -> its session (bounded: ranks < MAX_WORLD)
        self.identity_refused = 0

    async def contribute(
        self,
        worker: int,
        world: int,
        step: int,
        name: str,
        grad: torch.Tensor,
        *,
        wait: float | None = None,
        session: Hashable = None,
    ) -> tuple[torch.Tensor, int]:
        """Add ``grad`` to its round; return (the mean, how many workers it averages).
        ``session`` is who sends it (see the module doc); None: an in-process caller."""
        world = world or self.default_world
        round_ = self._add(worker, world, step, name, grad, session=session)
        try:
            return await self._wait((step, name), round_, worker, wait)
        finally:
            self._answered(round_)  # the caller makes its answer of the mean at once

    def _add(
        self, worker: int, world: int, step: int, name: str, grad: torch.Tensor, *, session: Hashable
    ) -> _Round:
        """Check everything, then put ``grad`` in its round (nothing changes if a check fails)."""
        self.check_owner(worker, session)
        self.charge(self._cost(worker, world, step, name, grad), f"{name!r} of step {step}")
        self._own(worker, session)
        return self._put(worker, world, step, name, grad)

    def check_owner(self, worker: int, session: Hashable) -> None:
        """ProtocolError (counted, logged) if ``worker`` belongs to a session other than
        ``session`` that left no more than twice the wait timeout ago."""
        owner = self._owners.get(worker)
        if owner is None or session is None or owner.session == session:
            return
        if time.monotonic() - owner.seen > 2 * self.wait_timeout:
            return  # its owner went silent (a worker that died): the rank may be taken again
        self.identity_refused += 1
        if self.identity_refused & (self.identity_refused - 1) == 0:  # the first, then powers of two
            event(log, logging.WARNING, "exchange: refused a request under a rank another session holds",
                  rank=worker, refused=self.identity_refused)  # fmt: skip
        raise ProtocolError(
            f"rank {worker} of the gradient exchange belongs to another client (a second worker with "
            f"the same RANK?); it is freed when that one leaves or is silent for {2 * self.wait_timeout:.3g}s"
        )

    def held_by(self, worker: int, session: Hashable) -> bool:
        """Whether ``worker``'s rank in the exchange belongs to ``session``."""
        owner = self._owners.get(worker)
        return owner is not None and owner.session == session

    def _own(self, worker: int, session: Hashable) -> None:
        if session is not None:
            self._owners[worker] = _Owner(session, time.monotonic())

    def _cost(self, worker: int, world: int, step: int, name: str, grad: torch.Tensor) -> int:
        """What adding ``grad`` would cost; raises (changing nothing) if it cannot be added."""
        check_identity(worker, world, step, name)
        if step <= self._done.get(name, -1):
            raise ProtocolError(f"step {step} of {name!r} was already averaged without worker {worker}")
        round_ = self._rounds.get((step, name))
        if round_ is None:
            return _nbytes(grad) + ROUND_COST + len(name)
        _check_like(round_, worker, world, grad, name)
        return _nbytes(grad)

    def _put(self, worker: int, world: int, step: int, name: str, grad: torch.Tensor) -> _Round:
        """Add a checked and paid-for ``grad`` to its round (settling it if it is complete)."""
        self.left.discard(worker)  # sending again is rejoining
        key = (step, name)
        round_ = self._rounds.get(key)
        if round_ is None:
            round_ = self._rounds[key] = _Round(world, ROUND_COST + len(name))
        round_.grads[worker] = grad
        self._settle(key, round_)
        return round_

    def attach(self, ledger: Ledger) -> None:
        """Count in ``ledger`` too from now on: the server process's one capacity (its store)."""
        if self._ledger is not ledger:
            self._ledger = ledger
            ledger.count(LEDGER_KIND, self.held)

    def charge(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` more held for ``what``, or refuse (CapacityExceeded) if they do not fit
        the exchange's capacity or the process's one ledger; ``count(-nbytes)`` gives them back."""
        if self.held + nbytes > self.capacity:
            raise CapacityExceeded(
                f"the gradient exchange holds {self.held} bytes; {nbytes} more for {what} exceed its "
                f"{self.capacity} (the server's --capacity)"
            )
        if self._ledger is not None:
            self._ledger.check(nbytes, f"the gradient exchange's {what}")
        self.count(nbytes)

    def count(self, nbytes: int) -> None:
        """What the exchange holds moves by ``nbytes`` (checked first where it grows)."""
        self.held += nbytes
        if self._ledger is not None:
            self._ledger.count(LEDGER_KIND, nbytes)

    async def _wait(
        self, key: tuple[int, str], round_: _Round, worker: int, wait: float | None
    ) -> tuple[torch.Tensor, int]:
        # The caller may ask for a shorter wait, never a longer one than the server's own.
        seconds = self.wait_timeout if wait is None else min(wait, self.wait_timeout)
        try:
            return await within(asyncio.shield(round_.result), seconds)
        except TimeoutError:
            self._withdraw(key, round_, worker)
            missing = sorted(set(range(round_.world)) - set(round_.grads) - self.left - {worker})[:16]
            step, name = key
            raise WaitTimeout(
                f"waited {seconds:.3g}s for the gradients of step {step} of {name!r} from worker(s) "
                f"{', '.join(map(str, missing))}"
            ) from None
        except asyncio.CancelledError:  # the caller went away (a cancelled gRPC call)
            self._withdraw(key, round_, worker)
            raise

    def _withdraw(self, key: tuple[int, str], round_: _Round, worker: int) -> None:
        """The worker gets an error, so its gradient does not count: take it out of the round."""
        if round_.settled:
            return
        grad = round_.grads.pop(worker, None)
        if grad is not None:
            self.count(-_nbytes(grad))
        if not round_.grads and self._rounds.get(key) is round_:
            del self._rounds[key]
            self.count(-round_.cost)

    def _answered(self, round_: _Round) -> None:
        """One contributor of a settled round has its answer out (or gave up): once all have, the
        mean's bytes are given back."""
        if not round_.settled or round_.answers <= 0:
            return  # not settled: a withdrawn gradient, never counted among its answers
        round_.answers -= 1
        if not round_.answers:
            self.count(-round_.mean_bytes)
            round_.mean_bytes = 0

    def leave(self, worker: int, session: Hashable = None, *, strict: bool = True) -> None:
        """``worker`` is done: rounds stop waiting for it. Once every worker of a world has left,
        the exchange forgets the run (the next one starts again at step 0). ``session``: who asks;
        None: the server itself. If the rank is another session's: ProtocolError (``strict``); not
        ``strict`` (a job's worker leaving or dropped), nothing changes unless ``session`` holds it."""
        if not 0 <= worker < MAX_WORLD:
            return  # no round can wait for a rank no world has
        if not strict and not self.held_by(worker, session):
            return  # the exchange's rank of that number is another client's (or nobody's)
        self.check_owner(worker, session)
        self._owners.pop(worker, None)
        self.left.add(worker)
        for key, round_ in list(self._rounds.items()):
            self._settle(key, round_)
        world = max((r.world for r in self._rounds.values()), default=self._last_world)
        if not self._rounds and world and set(range(world)) <= self.left:
            self.left.clear()
            self._owners.clear()
            self.count(-sum(NAME_COST + len(name) for name in self._done))
            self._done.clear()

    def _settle(self, key: tuple[int, str], round_: _Round) -> None:
        expected = set(range(round_.world)) - self.left
        if not round_.grads or not expected <= set(round_.grads):
            return
        del self._rounds[key]
        round_.settled = True
        round_.answers = len(round_.grads)
        step, name = key
        if name not in self._done:  # the name outlives its round: its cost moves over
            self.count(NAME_COST + len(name))
        self._done[name] = max(step, self._done.get(name, -1))
        self._last_world = round_.world
        grads = [round_.grads[w] for w in sorted(round_.grads)]
        released = round_.cost + sum(_nbytes(g) for g in grads)
        self.rounds_done += 1
        task = asyncio.ensure_future(asyncio.to_thread(_mean, grads))  # off the loop: N x size adds
        self._means.add(task)
        task.add_done_callback(lambda done: self._deliver(round_, done, released))

    def _deliver(self, round_: _Round, done: asyncio.Task[torch.Tensor], released: int) -> None:
        self._means.discard(done)
        ok = not done.cancelled() and done.exception() is None
        round_.mean_bytes = _nbytes(done.result()) if ok and round_.answers else 0
        self.count(round_.mean_bytes - released)  # the gradients go; the mean stays until answered
        if round_.result.done():
            return
        if done.cancelled():
            round_.result.cancel()
        elif done.exception() is not None:
            round_.result.set_exception(done.exception())  # type: ignore[arg-type]
        else:
            round_.result.set_result((done.result(), len(round_.grads)))

    # -- the frame protocol ---------------------------------------------------------------------
    async def on_allreduce(self, request: Request) -> None:
        head = wps.PsHead.decode(request.meta)
        metas = wm.decode_records(request.meta)
        codec = from_wire(wps.decode_codec(request.meta))
        request.meta.done()
        world = head.world or self.default_world
        session = frame_session(request, head)
        if len({m.name for m in metas}) != len(metas):
            raise ProtocolError("ALLREDUCE names the same tensor twice")
        self.check_owner(head.worker, session)
        for meta in metas:  # who is asking, and for what, before a byte is read
            check_identity(head.worker, world, head.clock, meta.name)
            if not meta.dtype.is_floating_point:
                raise InvalidTensor(f"{meta.name!r}: only floating-point gradients can be averaged")
        sent = (
            sum(m.nbytes for m in metas) if codec is None else payload_total(codec, (m.numel for m in metas))
        )
        if sent != request.header.data_len:
            raise InvalidTensor("the records' sizes do not add up to the frame's data length")
        decoded = sum(m.nbytes for m in metas)
        grads = await self._received(request, metas, codec, decoded)
        # All of the request's tensors join their rounds, or none: every check first.
        pairs = list(zip(metas, grads, strict=True))
        self.check_owner(head.worker, session)  # again: another session may have taken it meanwhile
        cost = sum(self._cost(head.worker, world, head.clock, m.name, g) for m, g in pairs)
        self.charge(cost, f"an ALLREDUCE of {len(metas)} tensors")
        self._own(head.worker, session)
        rounds = [self._put(head.worker, world, head.clock, m.name, g) for m, g in pairs]
        wait = head.wait_ms / 1000 if head.wait_ms else None
        try:
            keys = [(head.clock, m.name) for m in metas]
            with request.waiting():
                waits = [self._wait(k, r, head.worker, wait) for k, r in zip(keys, rounds, strict=True)]
                results = await asyncio.gather(*waits, return_exceptions=True)
            for result in results:  # every wait is over (each answered below), then the first error
                if isinstance(result, BaseException):
                    raise result
            means = [mean for mean, _ in results]  # type: ignore[misc]
            count = min((n for _, n in results), default=0)  # type: ignore[misc]
            out = [TensorMeta(m.name, m.dtype, m.shape, m.nbytes) for m in metas]
            await request.reply(wm.encode_records(out) + wps.encode_u32(count), [byte_view(t) for t in means])
        finally:
            for round_ in rounds:  # the means were sent (or never will be): their bytes go
                self._answered(round_)

    async def _received(
        self, request: Request, metas: Sequence[TensorMeta], codec: Codec | None, decoded: int
    ) -> list[torch.Tensor]:
        """The request's gradients, read (and decoded, in a worker thread) into tensors whose
        bytes, and the payloads' while they are decoded, are held against the capacity first."""
        scratch = request.header.data_len if codec is not None else 0
        self.charge(decoded + scratch, f"an ALLREDUCE of {len(metas)} tensors")
        try:
            grads = [empty_for(m) for m in metas]
            if codec is None:
                await request.receive([byte_view(g) for g in grads])
                return grads
            payloads = [torch.empty(codec.payload_bytes(m.numel), dtype=torch.uint8) for m in metas]
            await request.receive([byte_view(p) for p in payloads])
            await asyncio.to_thread(decode_all, codec, payloads, grads)
            return grads
        finally:
            self.count(-(decoded + scratch))  # ``_add`` charges each gradient it keeps


def frame_session(request: Request, head: wps.PsHead) -> Hashable:
    """Who sends a frame-protocol request: the session number in ``seq`` (an ExchangeClient's, or
    a parameter-server worker's incarnation), else (an older client) the host it comes from."""
    return ("seq", head.seq) if head.seq else ("host", host_of(request.peer))


def host_of(peer: str) -> str:
    """``tcp://10.0.0.5:4321``, ``ipv4:10.0.0.5:4321`` or ``ipv6:[::1]:4321`` without the port."""
    return peer.rpartition(":")[0] or peer


def check_identity(worker: int, world: int, step: int, name: str) -> None:
    """Who a gradient says it is from, and for what: checked before anything changes."""
    if not 0 < world <= MAX_WORLD:
        raise ProtocolError(f"a world of {world} workers (set world-size, or ps serve with --workers)")
    if not 0 <= worker < world:
        raise ProtocolError(f"worker {worker} is not a rank of a world of {world}")
    if not 0 <= step < 1 << 63:
        raise ProtocolError(f"step {step} is out of range")
    validate_name(name)


def _check_like(round_: _Round, worker: int, world: int, grad: torch.Tensor, name: str) -> None:
    if world != round_.world:
        raise ProtocolError(
            f"worker {worker} says the world of {name!r} has {world} workers, not {round_.world}"
        )
    if worker in round_.grads:
        raise ProtocolError(f"worker {worker} sent {name!r} twice for one step")
    first = next(iter(round_.grads.values()), None)
    if first is not None and (first.dtype != grad.dtype or first.shape != grad.shape):
        raise InvalidTensor(
            f"{name!r} from worker {worker} is {grad.dtype}{list(grad.shape)}; "
            f"the others sent {first.dtype}{list(first.shape)}"
        )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _mean(grads: list[torch.Tensor]) -> torch.Tensor:
    """The mean of ``grads``, summed in the order given (every worker gets the same bits)."""
    mean = grads[0].clone() if len(grads) > 1 else grads[0]
    for grad in grads[1:]:
        mean.add_(grad)
    return mean.div_(len(grads))
