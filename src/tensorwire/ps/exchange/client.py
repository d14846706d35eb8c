"""The client of the gradient exchange: a drop-in ``allreduce`` of gradients over one or more servers.

::

    with ExchangeClient("tcp://ps-host:7070") as exchange:   # rank, world size from torchrun/env
        for x, y in loader:
            loss_fn(model(x), y).backward()
            exchange.average_gradients(model)   # every worker now holds the same mean gradients
            optimizer.step(); optimizer.zero_grad()

Each call averages this worker's tensors for one step (the client counts steps) and writes the
mean over the live workers into the same tensors, in place. Every worker passes the same names,
dtypes and shapes in the same order (a model's ``named_parameters`` does). Leaving (``close``, or
the end of the ``with``) tells every server not to wait for this worker any more. Clients
generated from ``train.GradientService`` (gRPC) take part in the same rounds (see
``tensorwire.ps.exchange.server``).

Several servers (``ExchangeClient(["tcp://a:7070", "tcp://b:7070"])``, or one comma-separated
string) share the work: the tensors are cut into pieces (a tensor that fits in one piece is sent
under its own name; a larger one is cut into element ranges named ``name#start:stop``), and each
piece is averaged on one server (``pieces.split``: by bytes, the least loaded server first, the same on
every worker since it depends only on the tensors' names, dtypes and shapes). Each server sees
every worker's part of its pieces, so with as many servers as workers, each on a host of its own,
every link carries what a ring allreduce's does: the tensors' bytes once each way.

The pieces of one server travel in requests of at most ``piece_bytes`` (``requests_of``), sent
over ``lanes`` connections per server with up to ``WINDOW`` requests in flight on each: a server
answers a request as soon as every worker's part of it is in, so the means of the first pieces
come back while later ones are still being sent; a connection's requests are served in order, so
a second lane lets the server read the next request while it answers one. Every worker sends the
same requests in the same order on the same lanes, so no server waits on a request that another
worker holds back behind one the server cannot answer yet.

``ExchangeClient(url, codec="topk:0.01+fp16")`` sends the gradients compressed, with error
feedback (``error_feedback=False`` turns it off; it keeps one residual per piece, the gradients'
size again); the means come back in full precision.

Tensors on a CUDA device are averaged in place too: each request's bytes go device -> pinned host
memory -> wire, piece by piece, the copy of each piece overlapping the send of the one before,
and its means come back through the same pinned buffer (one per request, reused every step) to
the device on a side stream, which the caller's stream waits for by event (``ps/worker/device.py``); a
codec encodes on the device, next to its residuals.

Failures. A server that is down, closes a connection, answers wrongly or does not answer in time
fails the call with a ``TensorwireError`` naming it (``ConnectError`` at construction,
``ConnectionLost``, ``ProtocolError``, ``TransferTimeout``/``WaitTimeout``) as soon as it
happens: the step's other requests are cancelled (dropping the connections they were on) and the
error is raised once they have stopped, so nothing lands in the caller's tensors afterwards; no
step waits longer than its deadline (twice ``timeout`` plus a margin). After a failed call the
tensors are not a mean: the pieces whose requests were answered hold the mean, the others this
worker's own values (with a codec, what it sent: its values decoded) or, where an answer broke
off, part of a mean. Do not step the optimizer on them. The step counter has moved on and the
connections the failure dropped stay closed, so ``close`` the client (it leaves every server it
can still reach, on a new connection where it must, which lets a new client take the rank back
at once) and make a new one.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

import torch

from tensorwire import transport as transports
from tensorwire._aio import LoopThread, asyncio_timeout
from tensorwire.compression import Codec, ErrorFeedback
from tensorwire.compression.codecs import resolve
from tensorwire.errors import ProtocolError
from tensorwire.ps.exchange.pieces import PIECE_BYTES, Layout, Plan, plan
from tensorwire.ps.worker.device import DeviceStaging, device_of, slices
from tensorwire.ps.worker.rendezvous import rank_and_world
from tensorwire.ps.worker.rpc import PsChannel, Sender
from tensorwire.ps.worker.shards import check_trainable
from tensorwire.security import TlsFiles, client_security
from tensorwire.transport.base import FrameChannel
from tensorwire.types import Address, TensorMeta
from tensorwire.wire.tensors import byte_view

T = TypeVar("T")
_MARGIN = 10.0  # seconds a client-side wait adds to the server's, so the server's error comes first
LANES = 1  # connections per server
WINDOW = 8  # requests in flight per connection
MAX_SERVERS = 1024
MAX_LANES = 16
_MAX_NOTES = 4  # other failures of a step named in the raised error's notes


@dataclass(frozen=True, eq=False)
class _Call:
    """One ``allreduce``: its step, the caller's tensors, their plan, each piece's view of its
    tensor (where its mean lands), with a codec each piece's payload, and for tensors on a device
    their ``staging`` (None: sent as they are)."""

    step: int
    tensors: list[torch.Tensor]
    plan: Plan
    views: list[torch.Tensor]
    payloads: list[torch.Tensor]
    staging: DeviceStaging | None

    def meta(self, number: int) -> TensorMeta:
        """The record piece ``number`` is sent under: a whole tensor's shape, else a range's."""
        piece, view = self.plan.pieces[number], self.views[number]
        shape = tuple(self.tensors[piece.tensor].shape) if piece.whole else (piece.stop - piece.start,)
        return TensorMeta(piece.name, view.dtype, shape, view.numel() * view.element_size())


@dataclass(eq=False)
class _Server:
    """One exchange server: its address and the lanes (connections) open to it."""

    address: Address
    lanes: list[FrameChannel]


class ExchangeClient:
    """One worker's connections to a gradient exchange (see the module doc).

    Lifecycle: the constructor connects to every server (all of them or none: a failure closes
    what it opened and raises, naming the server); ``allreduce`` once per step from one thread at
    a time; ``close`` (or the end of the ``with``) once, after which ``allreduce`` refuses."""

    def __init__(
        self,
        servers: str | Sequence[str],
        *,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float = 120.0,
        connect_timeout: float = 10.0,
        token: str | None = None,
        tls: TlsFiles | None = None,
        codec: Codec | str | None = None,
        error_feedback: bool | None = None,
        lanes: int = LANES,
        piece_bytes: int = PIECE_BYTES,
        staging: DeviceStaging | None = None,
    ) -> None:
        urls = _server_urls(servers)
        if not 1 <= lanes <= MAX_LANES or piece_bytes < 1:
            raise ValueError(f"lanes must be 1..{MAX_LANES} and piece_bytes positive: {lanes}, {piece_bytes}")
        self.addresses = [Address.parse(url) for url in urls]
        self.address = self.addresses[0]  # the one server of the single-server client; kept for its callers
        self.lanes = lanes
        self.piece_bytes = piece_bytes
        # For CUDA tensors: one staging per device, made on first use; or one given (tests stand a
        # host copier in for the device: every allreduce is then staged).
        self._staging = staging
        self._stagings: dict[torch.device, DeviceStaging | None] = {}
        self.codec = resolve(codec)
        if error_feedback is None:
            error_feedback = self.codec is not None and self.codec.lossy
        self.feedback = ErrorFeedback(self.codec) if error_feedback and self.codec is not None else None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.rank, self.world_size = rank_and_world(rank, world_size)
        self.timeout = timeout
        self.step = 0  # the step the next allreduce is for
        # This client's session: the exchange binds the rank to it (another client cannot send
        # under the rank meanwhile), as a parameter server binds a worker's rank to its incarnation.
        self.session = secrets.randbits(63) or 1
        # A step waits for the slowest worker (the servers give up after ``timeout``) and then for
        # its bytes to move: twice the timeout bounds both, so a server that stops answering mid-step
        # cannot hold the caller for ever.
        self._step_wait = 2 * timeout + _MARGIN
        self._options = transports.TransportOptions(
            connect_timeout, timeout + _MARGIN, security=client_security(tls, token)
        )
        self._sender = Sender(self.rank, self.world_size, int(self.timeout * 1000))
        self._plan_cache: Plan | None = None
        self._thread = LoopThread("tensorwire-exchange")
        self._servers: list[_Server] = []
        self._closed = False
        self._connect(urls)

    def _connect(self, urls: Sequence[str]) -> None:
        """Open every server's lanes, all of them or none (a failure stops the loop and raises)."""
        try:
            wait = self._options.connect_timeout + _MARGIN
            self._servers = self._thread.call(self._open_all(), wait, f"connecting to {', '.join(urls)}")
        except BaseException:
            self._closed = True
            self._thread.stop()
            raise

    def allreduce(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Replace each tensor by the mean of that tensor over the live workers, for this step;
        return how many workers the mean is over (the fewest any server saw; ``world_size`` when
        there is nothing to average). On an error the tensors are not a mean (the module doc says
        what they hold)."""
        if self._closed:
            raise ProtocolError("the exchange client is closed")
        items = list(tensors.items())
        for name, tensor in items:
            check_trainable(name, tensor)
        call = self._prepare(items)
        self.step += 1
        if call.staging is not None:
            call.staging.after_compute()  # the copies read the gradients once this thread made them
        what = f"the allreduce of step {call.step}"  # a backstop: the step's own deadline fires first
        count: int = self._thread.call(self._allreduce(call), self._step_wait + _MARGIN, what)
        if call.staging is not None:
            call.staging.order_compute()  # this thread's stream waits for the means (the host does not)
        return count

    def average_gradients(self, model: torch.nn.Module) -> int:
        """``allreduce`` of the ``.grad`` of every parameter of ``model`` (zeros where it has none)."""
        grads = {}
        for name, param in model.named_parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads[name] = param.grad
        return self.allreduce(grads)

    def close(self) -> None:
        """Leave every server (the other workers' rounds stop waiting for this one), each within
        ``connect_timeout``, and close every connection; then raise the first failure to leave, if
        any (naming its server). A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        servers, self._servers = self._servers, []
        try:
            wait = 2 * self._options.connect_timeout + _MARGIN  # the leaves' own timeouts fire first
            self._thread.call(self._leave_all(servers), wait, "leaving the exchange")
        finally:
            self._thread.stop()

    def __enter__(self) -> ExchangeClient:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if ev is None:
            self.close()
            return
        try:
            self.close()
        except Exception as exc:  # the error in flight (often the same dead server) says more
            ev.add_note(f"leaving the exchange failed too: {exc}")

    # -- preparing a step -----------------------------------------------------------------------
    def _prepare(self, items: list[tuple[str, torch.Tensor]]) -> _Call:
        """This step's call: the plan of these tensors, each piece's view of its tensor and, with a
        codec, each piece's payload (with error feedback the views now hold what is sent)."""
        plan = self._plan(tuple((name, t.dtype, tuple(t.shape)) for name, t in items))
        flats = [t.view(-1) for _, t in items]
        views = [flats[p.tensor][p.start : p.stop] for p in plan.pieces]
        payloads = (
            [self._encode(p.name, v) for p, v in zip(plan.pieces, views, strict=True)] if self.codec else []
        )
        staging = self._staging_for([t for _, t in items])
        return _Call(self.step, [t for _, t in items], plan, views, payloads, staging)

    def _staging_for(self, tensors: list[torch.Tensor]) -> DeviceStaging | None:
        device = device_of(tensors, "the tensors of one allreduce")
        if self._staging is not None:
            return self._staging
        if device not in self._stagings:
            self._stagings[device] = DeviceStaging.for_device(device)
        return self._stagings[device]

    def _plan(self, layout: Layout) -> Plan:
        """``split`` of a layout and its requests, kept for the next call with the same layout (a
        training loop's every step): one plan, the last layout's."""
        if self._plan_cache is None or self._plan_cache.layout != layout:
            self._plan_cache = plan(layout, len(self.addresses), self.piece_bytes)
        return self._plan_cache

    def _encode(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        assert self.codec is not None
        if self.feedback is not None:  # the piece is overwritten with what was sent: the mean replaces it
            return self.feedback.encode(name, flat)
        return self.codec.encode(flat)

    # -- on the loop ----------------------------------------------------------------------------
    async def _open_all(self) -> list[_Server]:
        """``lanes`` connections to every server, all opened at once; none left open on a failure."""
        opened = await asyncio.gather(
            *(
                transports.open_channel(a, self._options, what="the gradient exchange")
                for a in self.addresses
                for _ in range(self.lanes)
            ),
            return_exceptions=True,
        )
        lanes = [o for o in opened if not isinstance(o, BaseException)]
        failed = [o for o in opened if isinstance(o, BaseException)]
        if failed:
            await _close_lanes(lanes)
            raise _first_with_notes(failed)
        n = self.lanes
        return [_Server(a, lanes[i * n : (i + 1) * n]) for i, a in enumerate(self.addresses)]

    async def _allreduce(self, call: _Call) -> int:
        # The deadline cancels what is still in flight and waits until it has stopped: once the
        # caller sees the error, nothing lands in its tensors any more.
        async with asyncio_timeout(self._step_wait, f"the allreduce of step {call.step}"):
            counts = await _gather_all(self._requests(call))
        return min(counts, default=self.world_size)

    def _requests(self, call: _Call) -> list[Awaitable[int]]:
        """One coroutine per request of the plan, each server's requests dealt to its lanes in turn,
        at most ``WINDOW`` in flight per lane. All of them start at once but send in plan order (the
        semaphores wake their waiters first come, first served), the same order on every worker;
        each builds its frame only when it goes, so the first ones leave without waiting for all."""
        rooms = [[asyncio.Semaphore(WINDOW) for _ in s.lanes] for s in self._servers]
        dealt = [0] * len(self._servers)
        requests: list[Awaitable[int]] = []
        for number, (server, _) in enumerate(call.plan.requests):
            lane, dealt[server] = dealt[server] % self.lanes, dealt[server] + 1
            requests.append(self._request(call, number, lane, rooms[server][lane]))
        return requests

    async def _request(self, call: _Call, number: int, lane: int, room: asyncio.Semaphore) -> int:
        async with room:
            return await self._send(call, number, lane)

    async def _send(self, call: _Call, number: int, lane: int) -> int:
        """One ALLREDUCE of the pieces of request ``number``; how many workers their means are over.

        The one place that chooses what a request sends (the payloads with a codec, else the pieces'
        views of the caller's tensors) and where its means land (those views). Device tensors go
        through the request's own pinned buffer (a staging key per request, so the window's
        requests stage at once): sent as their copies complete, landed there, copied back."""
        index, batch = call.plan.requests[number]
        server = self._servers[index]
        metas = [call.meta(n) for n in batch]
        sources = [(call.payloads if self.codec else call.views)[n] for n in batch]
        key = f"{server.address}/{number}"
        hosts: list[torch.Tensor] = []
        data: Sequence[memoryview]
        if call.staging is None:
            data = [byte_view(t) for t in sources]
            landing = [byte_view(call.views[n]) for n in batch]  # the means land in the caller's tensors
        else:
            data, host = await call.staging.send(key, sources, reserve=sum(m.nbytes for m in metas))
            hosts = slices(host, [m.nbytes for m in metas])
            landing = [byte_view(h) for h in hosts]
        expected = [(m.name, m.dtype, m.shape) for m in metas]

        def land(answer: list[TensorMeta]) -> list[memoryview]:
            if [(m.name, m.dtype, m.shape) for m in answer] != expected:
                raise ProtocolError(f"{server.address} answered with other tensors than were sent")
            return landing

        self.bytes_sent += sum(len(d) for d in data)
        what = f"the mean of step {call.step} from {server.address}"
        codec = self.codec.name if self.codec else None
        rpc = PsChannel(server.lanes[lane], self._sender)
        try:
            count = await rpc.allreduce(call.step, self.session, metas, data, land, codec=codec, what=what)
        except Exception as exc:
            _name(exc, server.address)
            raise
        if not 1 <= count <= self.world_size:  # a peer-sent number: never passed on unchecked
            raise ProtocolError(
                f"{server.address} averaged over {count} workers in a world of {self.world_size}"
            )
        if call.staging is not None:
            call.staging.land(key, [call.views[n] for n in batch], hosts)
        self.bytes_received += sum(len(v) for v in landing)
        return count

    async def _leave_all(self, servers: list[_Server]) -> None:
        """Leave every server, each on its own (one that fails does not keep the others from
        hearing it); then close every connection and raise the first failure."""
        left = await asyncio.gather(*(self._leave(s) for s in servers), return_exceptions=True)
        await _close_lanes(lane for s in servers for lane in s.lanes)
        failures = [r for r in left if isinstance(r, BaseException)]
        if failures:
            raise _first_with_notes(failures)

    async def _leave(self, server: _Server) -> None:
        what = f"leaving the exchange at {server.address}"
        try:
            lane = next((lane for lane in server.lanes if not lane.closed), None)
            if lane is None:  # a failed step broke every lane: the server must still hear it
                lane = await transports.open_channel(server.address, self._options, what=what)
                server.lanes.append(lane)  # closed with the others
            timeout = self._options.connect_timeout
            await PsChannel(lane, self._sender).leave(self.step, self.session, what=what, timeout=timeout)
        except Exception as exc:
            _name(exc, server.address)
            raise


def _server_urls(servers: str | Sequence[str]) -> list[str]:
    """The URLs of ``servers`` (a list, or one comma-separated string); ValueError for none, too
    many or an empty one."""
    urls = [u.strip() for u in servers.split(",")] if isinstance(servers, str) else list(servers)
    if not 1 <= len(urls) <= MAX_SERVERS or not all(urls):
        raise ValueError(f"an exchange needs 1 to {MAX_SERVERS} server URLs, not {servers!r}")
    return urls


def _name(exc: BaseException, address: Address) -> None:
    """Make sure an error names the server it came from (a server's own error message may not)."""
    if str(address) not in str(exc):
        exc.add_note(f"from the exchange server at {address}")


async def _close_lanes(lanes: Iterable[FrameChannel]) -> None:
    for lane in lanes:
        await lane.close()


async def _gather_all(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Run them all at once; on the first failure cancel the others and wait until they have
    stopped (a request cancelled mid-flight drops its connection, and its reader with it), so that
    nothing lands in the caller's tensors once the error is out; raise that failure (a dead
    server's, not the timeouts of the rounds it would leave waiting), noting the others."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # also when the step's deadline cancels this
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    failures = [e for t in tasks if t in done and (e := t.exception()) is not None]
    if failures:
        raise _first_with_notes(failures)
    return [t.result() for t in tasks]


def _first_with_notes(failures: Sequence[BaseException]) -> BaseException:
    """The first failure, with a note for each other different one (a few: a dead server fails
    every request it had at once)."""
    first, told = failures[0], {str(failures[0])}
    for other in failures[1:]:
        if str(other) not in told and len(told) <= _MAX_NOTES:
            told.add(str(other))
            first.add_note(f"and: {type(other).__name__}: {other}")
    return first
