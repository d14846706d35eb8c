"""Which route a put or a get takes: the one question both the ``AsyncClient`` and the blocking
client's inline path (inline.py) ask (``Routes``), so that the two never disagree; and each route's
way for the ``AsyncClient`` (``Transfers``).

A put of one tensor takes one of five routes, a get into one tensor one of five, chosen in this
order from what the transport can do (its capabilities, ``transport/base.py``; never its scheme),
the tensor's device and size, and the client's options:

========== ======================================================= ==========================
route      when                                                    how (module)
========== ======================================================= ==========================
DIRECT     a CUDA tensor, and the transport moves device memory    ``DeviceDirect``
           itself now (``gpu_direct``)
STAGED     a CUDA tensor, and the transport is ``Ranged``          pinned host buffers
                                                                   (staging.py)
HOST       (get) a CUDA ``out`` on any other transport             through a CPU tensor
STRIPED    more than one stripe (``stripe.stripe_count``: at      several connections
           least ``stripe_bytes``, ``stripes`` not 1), a           (stripe.py)
           ``Ranged`` transport that is ``parallel``, and (get)
           no ``out`` or a contiguous CPU one
RESUMABLE  (put) at least ``resumable_bytes``, a ``Resumable``     PUT_RESUMABLE
           transport
PLAIN      everything else                                         one PUT or GET
========== ======================================================= ==========================

The PLAIN get is the same operation on either side (``plain_get``).

A get's size is known from its ``out``, or from the last transfer of the same name this client
made (``moved``): a get of a name never moved before, with no ``out``, is never striped.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

import torch

from tensorwire.client import staging, stripe
from tensorwire.client.batches import Landing, TensorBatch
from tensorwire.client.options import ClientOptions, transport_options
from tensorwire.errors import UnsupportedTransport, VersionChanged
from tensorwire.transport.base import (
    DeviceDirect,
    Ranged,
    Resumable,
    Transport,
    as_ranged,
    as_resumable,
    new_upload,
)
from tensorwire.types import Address, TensorMeta
from tensorwire.wire.names import validate_name
from tensorwire.wire.tensors import byte_view, check_out, empty_for, sendable

T = TypeVar("T")
Progress = Callable[[int], None]

SIZES_KEPT = 65536  # names whose size a client remembers: a hint, not a registry


class Route(enum.Enum):
    DIRECT = "direct"
    STAGED = "staged"
    HOST = "host"
    STRIPED = "striped"
    RESUMABLE = "resumable"
    PLAIN = "plain"


class Routes:
    """One client's answers to "which route?", and the sizes of the tensors it moved."""

    def __init__(self, options: ClientOptions) -> None:
        self._options = options
        self._sizes: dict[str, int] = {}

    def put(self, t: Transport, nbytes: int, cuda: bool) -> Route:
        """The route of a put of ``nbytes`` (from a CUDA tensor: ``cuda``) over ``t``'s kind."""
        if cuda and direct(t):
            return Route.DIRECT
        if cuda and isinstance(t, Ranged):
            return Route.STAGED
        if self.stripes(nbytes) > 1 and _stripes_pay(t):
            return Route.STRIPED
        resumable = self._options.resumable_bytes
        if resumable and nbytes >= resumable and isinstance(t, Resumable):
            return Route.RESUMABLE
        return Route.PLAIN

    def get(self, t: Transport, name: str, out: torch.Tensor | None) -> Route:
        """The route of a get of ``name`` into ``out`` (None: a new tensor) over ``t``'s kind."""
        if out is not None and out.is_cuda:
            if direct(t):
                return Route.DIRECT
            return Route.STAGED if isinstance(t, Ranged) else Route.HOST
        striped = self.stripes(self.size(name, out)) > 1 and _stripes_pay(t)  # the cheap question first
        if striped and (out is None or (out.is_cpu and out.is_contiguous())):
            return Route.STRIPED
        return Route.PLAIN

    def stripes(self, nbytes: int) -> int:
        """Over how many connections ``nbytes`` would travel, where the transport allows: asked
        first, since it costs nothing and is 1 for most tensors."""
        return stripe.stripe_count(nbytes, self._options.stripes, self._options.stripe_bytes)

    def size(self, name: str, out: torch.Tensor | None) -> int:
        """The bytes a get of ``name`` into ``out`` will move, as far as this client knows (0: not)."""
        return out.numel() * out.element_size() if out is not None else self._sizes.get(name, 0)

    def moved(self, name: str, nbytes: int) -> None:
        """A transfer of ``name`` moved ``nbytes``: what the next get of it is routed by."""
        if len(self._sizes) >= SIZES_KEPT:  # start over rather than grow
            self._sizes.clear()
        self._sizes[name] = nbytes


class Runs(Protocol):
    """The client's retrying call (``AsyncClient._run``)."""

    def __call__(
        self, op: Callable[[Transport], Awaitable[T]], idempotent: bool = True, attempts: int = 0
    ) -> Awaitable[T]: ...


class Transfers:
    """One client's puts and gets of one tensor, each by its route, over the client's retrying
    call (``run``); ``capable`` is the transport whose kind says what the client's connections can
    do (opened, with retries, if there is none yet). It keeps what the routes need between calls:
    the striping lanes, the pinned host buffers, and where resumed puts went on from."""

    def __init__(
        self, address: Address, options: ClientOptions, run: Runs, capable: Callable[[], Awaitable[Transport]]
    ) -> None:
        self.routes = Routes(options)
        self.resumed_at: list[int] = []  # where each resumed put went on from (bytes already verified)
        self._address = address
        self._options = options
        self._run = run
        self._capable = capable
        self._stripes: stripe.Stripes | None = None
        self._pool: staging.PinnedPool | None = None  # host buffers for CUDA tensors, made on first use

    async def put(self, name: str, tensor: torch.Tensor, progress: Progress | None, attempts: int) -> int:
        """``AsyncClient.put`` by its route (``attempts``: made already, elsewhere)."""
        size = tensor.numel() * tensor.element_size()
        self.routes.moved(name, size)
        route = self.routes.put(await self._capable(), size, tensor.is_cuda)
        if route is Route.DIRECT:
            validate_name(name)
            return await self._run(lambda t: _as_direct(t).put_device(name, tensor))
        if route is Route.STAGED:
            validate_name(name)
            copier = staging.copier_for(tensor)
            upload, meta = await staging.put_staged(self._run, self._pinned(), name, tensor, copier)
            return await self._commit(upload, meta)
        if route is Route.STRIPED:
            return await self._put_striped(name, tensor, self.routes.stripes(size))
        if route is Route.RESUMABLE:
            return await self._put_resumable(name, tensor, progress)
        batch = TensorBatch([(name, tensor)])
        return await self._run(lambda t: t.put(batch, progress), attempts=attempts)

    async def get(
        self, name: str, out: torch.Tensor | None, progress: Progress | None, attempts: int = 0
    ) -> tuple[torch.Tensor, int]:
        """The tensor and the version it was read at, by the get's route."""
        route = self.routes.get(await self._capable(), name, out)
        if out is not None and route in (Route.DIRECT, Route.STAGED, Route.HOST):
            return await self._get_device(name, out, route, progress)
        if route is Route.STRIPED:
            k = self.routes.stripes(self.routes.size(name, out))
            return await self._until_steady(lambda: self._get_striped(name, out, k))
        tensor, version = await self._run(plain_get(name, out, progress), attempts=attempts)
        self.routes.moved(name, tensor.numel() * tensor.element_size())
        return tensor, version

    @property
    def lanes(self) -> stripe.Stripes | None:
        """The striping lanes, once a striped transfer opened them."""
        return self._stripes

    async def close(self) -> None:
        if self._stripes is not None:
            stripes, self._stripes = self._stripes, None
            await asyncio.get_running_loop().run_in_executor(None, stripes.close)

    async def _get_device(
        self, name: str, out: torch.Tensor, route: Route, progress: Progress | None
    ) -> tuple[torch.Tensor, int]:
        """Into a CUDA ``out``: by the transport itself, staged, or through a CPU tensor (gRPC)."""
        if route is Route.DIRECT:  # GPU-direct: the engine reads into device memory
            return out, await self._run(lambda t: _as_direct(t).get_device(name, out))
        if route is Route.STAGED:
            return await self._until_steady(lambda: self._get_staged(name, out))
        host, version = await self.get(name, None, progress)
        check_out(TensorMeta(name, host.dtype, tuple(host.shape), 0, version), out, device_ok=True)
        return out.copy_(host), version

    async def _until_steady(self, read: Callable[[], Awaitable[T]]) -> T:
        """``read()``, made again while the tensor changes under it (VersionChanged: its ranges were
        pinned to a version the tensor has moved on from), at most ``retries`` more times."""
        for attempt in itertools.count():
            try:
                return await read()
            except VersionChanged:
                if attempt >= self._options.retries:
                    raise
        raise AssertionError("unreachable")

    async def _stat(self, name: str) -> TensorMeta:
        metas = await self._run(lambda t: t.stat([name]))
        return metas[0]

    async def _commit(self, upload: int, meta: TensorMeta) -> int:
        """PUT_COMMIT: publish an upload whose ranges are all in (striped and staged puts)."""
        return await self._run(lambda t: as_ranged(t, "a commit").commit(upload, meta), idempotent=False)

    async def _put_resumable(self, name: str, tensor: torch.Tensor, progress: Progress | None) -> int:
        """PUT_RESUMABLE: each attempt after the first asks how much of the upload the server holds,
        verified, and sends the rest."""
        validate_name(name)
        sent = sendable(tensor, name)
        view = byte_view(sent)
        meta = TensorMeta(name, sent.dtype, tuple(sent.shape), view.nbytes)
        upload = new_upload()
        tried = False

        async def attempt(t: Transport) -> int:
            nonlocal tried
            resumable = as_resumable(t, "a resumable put")
            offset = 0
            if tried:
                offset = await resumable.resume_point(upload, meta)
                self.resumed_at.append(offset)
            tried = True
            return await resumable.put_resumable(upload, meta, view, offset, progress)

        return await self._run(attempt)

    # -- striping (stripe.py) --------------------------------------------------------------------
    def _lanes(self) -> stripe.Stripes:
        if self._stripes is None:
            self._stripes = stripe.Stripes(self._address, transport_options(self._options))
        return self._stripes

    async def _put_striped(self, name: str, tensor: torch.Tensor, k: int) -> int:
        """PUT_RANGE of each range on its own connection, then one PUT_COMMIT publishes the tensor."""
        validate_name(name)
        sent = sendable(tensor, name)
        meta = TensorMeta(name, sent.dtype, tuple(sent.shape), sent.numel() * sent.element_size())
        upload = new_upload()
        ops = stripe.put_ops(upload, meta, byte_view(sent), k)
        await self._lanes().run(ops, self._options.retries, self._options.delay)
        return await self._commit(upload, meta)

    async def _get_striped(self, name: str, out: torch.Tensor | None, k: int) -> tuple[torch.Tensor, int]:
        """STAT for the version, then each range over its own connection, pinned to that version."""
        meta = await self._stat(name)
        target = out if out is not None else empty_for(meta)
        check_out(meta, target)
        self.routes.moved(name, meta.nbytes)
        if self.routes.stripes(meta.nbytes) <= 1:  # it shrank: one GET will do
            return await self.get(name, out, None)
        ops = stripe.get_ops(meta, byte_view(target), k)
        await self._lanes().run(ops, self._options.retries, self._options.delay)
        return target, meta.version

    # -- CUDA tensors (staging.py) ----------------------------------------------------------------
    def _pinned(self) -> staging.PinnedPool:
        if self._pool is None:
            self._pool = staging.PinnedPool()
        return self._pool

    async def _get_staged(self, name: str, out: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Into a device tensor through pinned buffers, pinned to the version a STAT saw."""
        meta = await self._stat(name)
        check_out(meta, out, device_ok=True)
        await staging.get_staged(self._run, self._pinned(), meta, out, staging.copier_for(out))
        return out, meta.version


def direct(t: Transport) -> bool:
    """Whether ``t`` moves CUDA tensors straight from and into device memory now."""
    return isinstance(t, DeviceDirect) and t.gpu_direct


def _stripes_pay(t: Transport) -> bool:
    """Whether ``t`` can stripe, and says it pays: ``Ranged`` and ``parallel``."""
    return isinstance(t, Ranged) and t.parallel


def plain_get(
    name: str, out: torch.Tensor | None, progress: Callable[[int], None] | None = None
) -> Callable[[Transport], Coroutine[Any, Any, tuple[torch.Tensor, int]]]:
    """The PLAIN route of a get: one GET of ``name`` into ``out`` (None: a new tensor), as an
    operation on a connection that answers with the tensor and the version read; each attempt
    lands afresh."""
    landing = Landing([name], {name: out} if out is not None else {})

    async def op(t: Transport) -> tuple[torch.Tensor, int]:
        landing.reset()
        await t.get([name], landing.sink, progress)
        return landing.finish()[name], landing.versions[name]

    return op


def _as_direct(transport: Transport) -> DeviceDirect:
    if not isinstance(transport, DeviceDirect):  # a reconnect reached another kind of server
        raise UnsupportedTransport(f"{transport.address.scheme}:// moves no device memory")
    return transport
