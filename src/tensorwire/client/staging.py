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

The device side is behind ``Copier`` so the pipeline (pieces, buffer reuse, ordering) runs on
machines without CUDA too: ``HostCopier`` copies synchronously, and tests use it.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

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
    """Asynchronous copies between a device tensor's bytes and host buffers."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        """Start ``dst.copy_(src)``; returns a handle for ``wait``."""
        ...

    async def wait(self, handle: object) -> None: ...


class HostCopier:
    """Copies done at once (CPU tensors; what tests use where there is no GPU)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        dst.copy_(src)
        return None

    async def wait(self, handle: object) -> None:
        return None


class CudaCopier:
    """Copies on a side stream of ``device``, ordered after the work already queued there."""

    def __init__(self, device: torch.device) -> None:
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
