"""CUDA tensors over the wire, staged through reusable pinned host buffers.

A device tensor's bytes cannot be handed to a socket. ``put`` of a CUDA tensor copies it to host
memory piece by piece (``PIECE_BYTES``) into page-locked buffers from a ``PinnedPool`` and sends
each piece as a PUT_RANGE of one upload while the GPU copies the next one (the copy runs on its own
CUDA stream, so the device-to-host DMA overlaps the network send); one PUT_COMMIT publishes the
tensor, so a half-sent one is never visible (the transport's ``Ranged`` capability: tcp://, tls://,
memory://). ``get(out=cuda_tensor)`` is the mirror: GET_RANGE of
each piece (pinned to the version a STAT saw) into a pinned buffer, then an asynchronous
host-to-device copy of it while the next piece arrives.

Pinned memory is costly to allocate (it is locked in RAM and registered with the driver), so the
pool keeps at most ``count`` buffers per client and reuses them for every transfer.

A request of the frame protocol that carries many tensors in one frame (a parameter-server push or
pull, an allreduce) cannot be cut into requests of its own: its bytes pass through one
``HostArena`` (a pinned buffer kept and reused from request to request). ``stage_out`` starts the
device-to-host copies of all its tensors, piece by piece, and hands the transport ``StagedSegments``
(the transport's ``StagedData``): the transport awaits each piece's copy just before it sends that
piece, so the copy of the next piece overlaps the send of this one. ``copy_in`` starts the copies
of an answer landed in the arena back into device tensors.

The device side is behind ``Copier`` so the pipeline (pieces, buffer reuse, ordering) runs on
machines without CUDA too: ``HostCopier`` copies synchronously, and tests use it or a copier of
their own that copies late, on a thread.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Protocol, TypeVar, overload

import torch

from tensorwire.errors import InvalidTensor
from tensorwire.transport.base import Transport, as_ranged, new_upload
from tensorwire.types import TensorMeta
from tensorwire.wire.dtypes import DTYPE_TO_CODE
from tensorwire.wire.tensors import byte_view

T = TypeVar("T")
Run = Callable[[Callable[[Transport], Awaitable[T]]], Awaitable[T]]

PIECE_BYTES = 8 << 20
POOL_BUFFERS = 4


class PinnedPool:
    """At most ``count`` host buffers of ``piece_bytes`` each, page-locked when CUDA is present,
    made on first use and reused by every staged transfer of one client."""

    def __init__(
        self, piece_bytes: int = PIECE_BYTES, count: int = POOL_BUFFERS, pin: bool | None = None
    ) -> None:
        if piece_bytes <= 0 or count < 2:
            raise ValueError(
                "a pinned pool needs positive pieces and at least two buffers (one to copy, one to send)"
            )
        self.piece_bytes = piece_bytes
        self.count = count
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.made = 0
        self._free: list[torch.Tensor] = []

    @property
    def free(self) -> int:
        """Buffers that ``take`` can hand out now (free ones, plus those not yet made)."""
        return len(self._free) + self.count - self.made

    def take(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        if self.made >= self.count:
            raise RuntimeError("every pinned buffer is in use")  # a bug in the pipeline, not the peer
        self.made += 1
        return torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        self._free.append(buf)


class Copier(Protocol):
    """Asynchronous copies between device memory and host buffers, in one queue (a CUDA stream):
    they complete in the order they were started, so waiting for one handle waits for every copy
    started before it.

    Lifecycle: in the thread that computes, ``after_compute`` before copying what it computed; on
    the event loop, ``copy`` any number of times, and ``wait`` for a handle before the host reads a
    copy's bytes or reuses its buffer; ``mark`` (a handle of everything started so far, kernels run
    ``inside()`` the queue included), then, in the thread that computes, ``compute_waits(mark)``
    before it uses what was copied to the device: its own queue waits, the host does not.
    """

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        """Start ``dst.copy_(src)``; returns a handle for ``wait``."""
        ...

    async def wait(self, handle: object) -> None: ...

    def after_compute(self) -> None:
        """Copies started from now on run after the work the calling thread has queued so far."""
        ...

    def mark(self) -> object:
        """A handle that completes once everything started so far has."""
        ...

    def compute_waits(self, handle: object) -> None:
        """Work the calling thread queues from now on runs after ``handle`` (not the host: it goes on)."""
        ...

    def inside(self) -> contextlib.AbstractContextManager[None]:
        """Kernels started in this context (a codec's decode) run in the copies' queue, in order."""
        ...


class HostCopier:
    """Copies done at once (CPU tensors; what tests use where there is no GPU)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        dst.copy_(src)
        return None

    async def wait(self, handle: object) -> None:
        return None

    def after_compute(self) -> None:
        return None

    def mark(self) -> object:
        return None

    def compute_waits(self, handle: object) -> None:
        return None

    def inside(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class CudaCopier:
    """Copies on a side stream of ``device``, ordered after the work already queued there."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.stream.wait_stream(torch.cuda.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self.stream)
        return event

    async def wait(self, handle: object) -> None:
        assert isinstance(handle, torch.cuda.Event)
        if not handle.query():  # type: ignore[no-untyped-call]  # synchronize() blocks: off the event loop
            await asyncio.get_running_loop().run_in_executor(None, handle.synchronize)

    def after_compute(self) -> None:
        # The caller's current stream, not the device's default one: a training loop may run
        # under torch.cuda.stream(...), and that is where its gradients are made.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def mark(self) -> object:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    def compute_waits(self, handle: object) -> None:
        assert isinstance(handle, torch.cuda.Event)
        torch.cuda.current_stream(self.device).wait_event(handle)

    def inside(self) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(self.stream)


def copier_for(tensor: torch.Tensor) -> Copier:
    return CudaCopier(tensor.device) if tensor.is_cuda else HostCopier()


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its own device (contiguous, no host copy)."""
    t = tensor.detach()
    t = t if t.is_contiguous() else t.contiguous()
    return (
        t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
    )


def pieces(nbytes: int, piece: int) -> list[tuple[int, int]]:
    return [(offset, min(piece, nbytes - offset)) for offset in range(0, nbytes, piece)]


async def put_staged(
    run: Run[object], pool: PinnedPool, name: str, tensor: torch.Tensor, copier: Copier
) -> tuple[int, TensorMeta]:
    """Send a device tensor piece by piece through ``pool`` into a new upload (PUT_RANGE): the copy
    of piece i+1 runs while piece i is sent. ``run`` runs one operation on the client's connection,
    with its retries. Returns the upload and its tensor's record, for the caller's PUT_COMMIT."""
    if tensor.dtype not in DTYPE_TO_CODE or tensor.layout is not torch.strided:
        raise InvalidTensor(f"{name!r}: a {tensor.dtype} {tensor.layout} tensor cannot be sent")
    src = flat_bytes(tensor)
    meta = TensorMeta(name, tensor.dtype, tuple(tensor.shape), src.numel())
    if not meta.nbytes:
        raise InvalidTensor(f"{name!r}: an empty device tensor is put with .cpu()")
    upload = new_upload()
    todo = deque(pieces(meta.nbytes, pool.piece_bytes))
    inflight: deque[tuple[int, int, torch.Tensor, object]] = deque()

    def launch() -> None:
        while todo and pool.free and len(inflight) < pool.count - 1:
            offset, length = todo.popleft()
            buf = pool.take()
            inflight.append((offset, length, buf, copier.copy(buf[:length], src[offset : offset + length])))

    launch()
    try:
        while inflight:
            offset, length, buf, handle = inflight.popleft()
            launch()  # the next piece's copy overlaps this piece's send
            await copier.wait(handle)
            data = byte_view(buf[:length])
            await run(functools.partial(_put_range, upload=upload, meta=meta, offset=offset, data=data))
            pool.give(buf)  # the transport returns once the kernel holds the bytes
    finally:
        for _, _, buf, handle in inflight:
            await copier.wait(handle)
            pool.give(buf)
    return upload, meta


async def get_staged(
    run: Run[object], pool: PinnedPool, meta: TensorMeta, out: torch.Tensor, copier: Copier
) -> None:
    """Fill the device tensor ``out`` with ``meta``'s tensor (at ``meta.version``), piece by piece
    through ``pool``: the copy of piece i to the device runs while piece i+1 arrives."""
    if not out.is_contiguous():
        raise InvalidTensor(f"{meta.name!r}: a device out must be contiguous")
    dst = flat_bytes(out)
    copying: deque[tuple[torch.Tensor, object]] = deque()
    try:
        for offset, length in pieces(meta.nbytes, pool.piece_bytes):
            if not pool.free:  # every buffer is being copied to the device: wait for the oldest
                buf, handle = copying.popleft()
                await copier.wait(handle)
                pool.give(buf)
            buf = pool.take()
            await run(functools.partial(_get_range, meta=meta, offset=offset, length=length, buf=buf))
            copying.append((buf, copier.copy(dst[offset : offset + length], buf[:length])))
    finally:
        for buf, handle in copying:
            await copier.wait(handle)
            pool.give(buf)


async def _get_range(t: Transport, *, meta: TensorMeta, offset: int, length: int, buf: torch.Tensor) -> None:
    await as_ranged(t, "staging a device tensor").get_range(meta, offset, byte_view(buf[:length]))


async def _put_range(t: Transport, *, upload: int, meta: TensorMeta, offset: int, data: memoryview) -> None:
    await as_ranged(t, "staging a device tensor").put_range(upload, meta, offset, data)


# -- one frame of many tensors through one reusable buffer -----------------------------------------
class HostArena:
    """One host buffer that the requests of one connection pass through (page-locked when CUDA is
    present), kept and reused from request to request; it grows to the largest request.

    ``last`` is the handle of the last copy started into or out of it: ``claim`` waits for it
    before handing the buffer out again, so no copy still reading or writing it sees its bytes
    change (copies complete in order: the last one done, all are)."""

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.last: object = None
        self.grown = 0  # times a larger buffer was made (once or twice per job: each is costly)

    async def claim(self, copier: Copier, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer, once every copy started on it has completed."""
        last, self.last = self.last, None
        if last is not None:
            await copier.wait(last)
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self.grown += 1
        return self.buffer[:nbytes]


class StagedSegments(Sequence[memoryview]):
    """A request's data in host memory, piece by piece, each piece ready once its device copy
    is (the transport's ``StagedData``): see ``stage_out``."""

    def __init__(self, copier: Copier, views: list[memoryview], ends: list[int], handles: list[object]):
        self._copier = copier
        self._views = views
        self._ends = ends  # where each piece ends, in bytes from the start of the data
        self._handles = handles  # each piece's copy (the last one started for it)
        self._ready = 0  # pieces known to be ready

    @overload
    def __getitem__(self, index: int) -> memoryview: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[memoryview]: ...

    def __getitem__(self, index: int | slice) -> memoryview | Sequence[memoryview]:
        return self._views[index]

    def __len__(self) -> int:
        return len(self._views)

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self._views)

    @property
    def last(self) -> object:
        """The handle of the last copy (into the arena these views are of)."""
        return self._handles[-1] if self._handles else None

    async def ready(self, end: int) -> None:
        """Wait for the copies of the pieces holding the first ``end`` bytes (the last of them is
        enough: copies complete in order)."""
        upto = min(bisect.bisect_left(self._ends, end) + 1, len(self._ends))
        if upto > self._ready:
            await self._copier.wait(self._handles[upto - 1])
            self._ready = upto


def stage_out(
    copier: Copier, host: torch.Tensor, sources: Sequence[torch.Tensor], piece_bytes: int = PIECE_BYTES
) -> StagedSegments:
    """Start copying the bytes of ``sources`` (contiguous tensors on the device), one after the
    other, into ``host`` (a buffer from ``HostArena.claim``, at least their size), in pieces of
    about ``piece_bytes``: a large tensor is cut, small ones share a piece. Returns the data to
    send, ready piece by piece; the transport sends piece i while piece i+1 is copied."""
    views: list[memoryview] = []
    ends: list[int] = []
    handles: list[object] = []
    start = offset = 0
    handle: object = None
    for source in sources:
        flat = flat_bytes(source)
        for at, length in pieces(flat.numel(), piece_bytes):
            handle = copier.copy(host[offset : offset + length], flat[at : at + length])
            offset += length
            if offset - start >= piece_bytes:
                views.append(byte_view(host[start:offset]))
                ends.append(offset)
                handles.append(handle)
                start = offset
    if offset > start:
        views.append(byte_view(host[start:offset]))
        ends.append(offset)
        handles.append(handle)
    return StagedSegments(copier, views, ends, handles)


def copy_in(copier: Copier, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> object:
    """Start copying each host slice into its device tensor, ``(device, host)`` pairs; returns the
    handle of the last copy (None when there is nothing to copy)."""
    handle: object = None
    for device, host in pairs:
        if host.numel():
            handle = copier.copy(flat_bytes_out(device), host)
    return handle


def flat_bytes_out(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat, writable uint8 view of its own memory."""
    if not tensor.is_contiguous():
        raise InvalidTensor("a staged copy lands in contiguous tensors only")
    return tensor.detach().reshape(-1).view(torch.uint8)
