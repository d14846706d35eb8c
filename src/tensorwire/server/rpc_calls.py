"""What the gRPC calls of a tensorwire server share (rpc.py's ``TensorService``, rpc_generations.py's
generation calls): errors as gRPC statuses with the tensorwire code in the trailers, the stall
watchdog, a streamed upload received into a reservation chunk by chunk, and work moved off the
event loop when it is large."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from tensorwire.errors import (
    CorruptFrame,
    ErrorCode,
    InvalidTensor,
    LimitExceeded,
    ProtocolError,
    TensorwireError,
    TransferTimeout,
    code_for_error,
)
from tensorwire.store import Reservation, TensorStore
from tensorwire.types import Limits
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.frame import CHECKSUM_KINDS
from tensorwire.wire.rpc import ERROR_KEY, RPC_GET_CHUNK_BYTES, RawChunk, decode_chunk, encode_chunk, meta_of

log = logging.getLogger("tensorwire.server")
T = TypeVar("T")

GRPC_CODES: dict[ErrorCode, grpc.StatusCode] = {
    ErrorCode.KEY_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.CAPACITY_EXCEEDED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.LIMIT_EXCEEDED: grpc.StatusCode.OUT_OF_RANGE,
    ErrorCode.INVALID_NAME: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.INVALID_TENSOR: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.PROTOCOL_ERROR: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.CORRUPT_FRAME: grpc.StatusCode.DATA_LOSS,
    ErrorCode.UNSUPPORTED_VERSION: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.PERSISTENCE_ERROR: grpc.StatusCode.INTERNAL,
    ErrorCode.SERVER_ERROR: grpc.StatusCode.INTERNAL,
    ErrorCode.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.GENERATION_RETIRED: grpc.StatusCode.NOT_FOUND,
    ErrorCode.PUBLISH_ABORTED: grpc.StatusCode.ABORTED,
}


class Watchdog:
    """Cancels the task it was made in once ``progress()`` has not been called for ``stall``
    seconds: one timer per call, re-armed only when it fires, instead of a timeout scope around
    every message (those cost a third of the throughput)."""

    def __init__(self, stall: float) -> None:
        self.stall = stall
        self.last = time.monotonic()
        self.fired = False
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(stall, self._check)

    def progress(self) -> None:
        self.last = time.monotonic()

    def _check(self) -> None:
        idle = time.monotonic() - self.last
        if idle < self.stall:
            self._handle = self._loop.call_later(self.stall - idle, self._check)
            return
        self.fired = True
        log.warning("cutting off a gRPC call that made no progress for %.3gs", idle)
        if self._task is not None:
            self._task.cancel()

    def close(self) -> None:
        self._handle.cancel()

    def cut_off(self) -> TransferTimeout:
        """What a call this watchdog cancelled (``fired``) raises instead of the cancellation,
        from the call's own task: the task is uncancelled, so the error reaches the client."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        return TransferTimeout(f"the client sent nothing for {self.stall:.3g}s")


class StreamedPut:
    """Receives the chunks of one Put into a reservation, checking each as it arrives."""

    def __init__(self, store: TensorStore, limits: Limits, batch: Reservation, watchdog: Watchdog) -> None:
        self.store = store
        self.limits = limits
        self.batch = batch
        self.watchdog = watchdog
        self.current: memoryview | None = None
        self.filled = 0
        self.total = 0

    async def receive(self, chunks: AsyncIterator[bytes]) -> None:
        async for raw in chunks:
            self.watchdog.progress()
            chunk = decode_chunk(raw)
            if chunk.tensor is not None:
                self._start(chunk.tensor)
            if chunk.data or chunk.checksum:
                await self._take(chunk)
        self._end_of_tensor()
        if not self.batch.metas:
            raise ProtocolError("Put carried no tensors")

    def _start(self, info: pb.TensorInfo) -> None:
        self._end_of_tensor()
        if len(self.batch.metas) >= self.limits.max_batch:
            raise LimitExceeded(f"a Put of more than {self.limits.max_batch} tensors")
        meta = meta_of(info)
        self.total += meta.nbytes
        if self.total > self.limits.max_request_bytes:
            raise LimitExceeded(f"a Put of more than {self.limits.max_request_bytes} bytes")
        part = self.store.reserve([meta.with_version(0)], self.batch)
        self.current, self.filled = part.buffers[0], 0

    async def _take(self, chunk: RawChunk) -> None:
        data = chunk.data
        if self.current is None:
            raise ProtocolError("tensor bytes before any tensor header")
        if self.filled + len(data) > self.current.nbytes:
            raise InvalidTensor("more bytes than the tensor's shape and dtype hold")
        if chunk.kind not in CHECKSUM_KINDS:
            raise ProtocolError(f"unknown checksum kind {chunk.kind}")
        target = self.current[self.filled : self.filled + len(data)]
        await off_loop(len(data), verified_copy, chunk, target)  # a large chunk: in a worker thread
        self.filled += len(data)

    def _end_of_tensor(self) -> None:
        if self.current is not None and self.filled != self.current.nbytes:
            raise InvalidTensor(f"a tensor ended after {self.filled} of its {self.current.nbytes} bytes")
        self.current = None


async def ready(value: T) -> T:
    return value


# A message or copy at least this large is handled in a worker thread (xxhash, memcpy and protobuf
# release the GIL); below it, the hop to the thread costs more than the work.
_OFF_LOOP_BYTES = 1 << 20


async def off_loop(size: int, work: Callable[..., T], *args: Any) -> T:
    if size < _OFF_LOOP_BYTES:
        return work(*args)
    job = asyncio.ensure_future(asyncio.to_thread(work, *args))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        # The thread writes into (or reads) store buffers that the caller gives back as it unwinds:
        # a cancelled call waits for it to finish first, or a buffer could be reused under it.
        await asyncio.wait([job])
        raise


def checked_chunk(data: memoryview, kind: int) -> bytes:
    return encode_chunk(data, kind, checksum(kind, data))


def verified_copy(chunk: RawChunk, target: memoryview) -> None:
    """Copy a chunk's data into its place once its checksum matches (nothing is kept otherwise)."""
    if checksum(chunk.kind, chunk.data) != chunk.checksum:
        raise CorruptFrame("a chunk's checksum does not match its data; nothing was kept")
    target[:] = chunk.data


async def answer(context: Any, run: Callable[[], Awaitable[T]]) -> T:
    """Run an operation; a tensorwire error becomes a gRPC error with its code in the trailers."""
    try:
        return await run()
    except TensorwireError as exc:
        await abort(context, exc)
        raise AssertionError("unreachable") from exc  # context.abort raises


async def abort(context: Any, exc: BaseException) -> None:
    code = code_for_error(exc)
    context.set_trailing_metadata(((ERROR_KEY, str(int(code))),))
    await context.abort(GRPC_CODES.get(code, grpc.StatusCode.INTERNAL), str(exc))


async def read_options(request: Any, limits: Limits, context: Any) -> tuple[int, int]:
    """The chunk size and checksum kind a read (Get, GetRanges) asks its answer in, the defaults
    filled in; the call is aborted (LimitExceeded, ProtocolError) for ones this server does not
    serve."""
    chunk = int(request.chunk_bytes) or RPC_GET_CHUNK_BYTES
    if not limits.min_chunk_bytes <= chunk <= limits.max_chunk_bytes:
        await abort(context, LimitExceeded(f"chunk size {chunk} outside the server's limits"))
    kind = int(request.checksum_kind) or ChecksumKind.XXH3_64
    if kind not in CHECKSUM_KINDS:
        await abort(context, ProtocolError(f"unknown checksum kind {kind}"))
    return chunk, kind


def serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())
