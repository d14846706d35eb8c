"""The gRPC transport: ``grpc://host:port``, the client side of ``TensorService`` (server/rpc.py).

Tensors travel in chunks of ~1 MiB (the message size grpcio moves fastest), each with its xxh3
checksum, and land in the caller's buffers as they arrive. grpcio needs one ``bytes`` object per
message: that is built once per chunk from a memoryview of the tensor on the way out, and copied
once into the destination on the way in. Errors are translated here, at the boundary: a gRPC
status becomes the tensorwire error its trailing metadata names (or the closest one).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from tensorwire._aio import within
from tensorwire.errors import (
    ConnectError,
    ConnectionLost,
    CorruptFrame,
    LimitExceeded,
    ProtocolError,
    ServerError,
    TensorwireError,
    TransferTimeout,
    error_for_code,
)
from tensorwire.security import Security, TlsFiles, grpc_channel_credentials
from tensorwire.transport.base import Progress, PutBatch, Sink, Transport
from tensorwire.types import Address, Generation, GenerationManifest, Limits, TensorMeta
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.v1 import tensor_service_pb2_grpc as pb_grpc
from tensorwire.wire import generations as wg
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.meta import ServerInfo
from tensorwire.wire.rpc import (
    ERROR_KEY,
    RPC_CHUNK_BYTES,
    RPC_GET_CHUNK_BYTES,
    SERVICE,
    decode_chunk,
    encode_chunk,
    generation_of,
    info_of,
    manifest_of,
    message_options,
    meta_of,
    part_info,
    pb_kind,
)

if TYPE_CHECKING:
    from tensorwire.transport import TransportOptions

_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}
_LOST_STATUS = '"execute_batch"'  # in the debug string of a send that failed as the call ended


class RpcTransport(Transport):
    """One gRPC channel to one server. Beyond ``Transport`` it is a ``PartPublisher`` and
    ``RangedGenerations`` (base.py): what ``tensorwire.sharded`` puts and reads with."""

    def __init__(
        self,
        address: Address,
        checksum_kind: ChecksumKind,
        chunk_size: int | None,
        timeout: float,
        security: Security,
    ) -> None:
        self.address = address
        self.info = ServerInfo(1, Limits(), 0, 0)
        self.timeout = timeout
        self._kind = checksum_kind
        self._chunk = chunk_size or RPC_CHUNK_BYTES
        self._get_chunk = chunk_size or RPC_GET_CHUNK_BYTES
        self._metadata = (("authorization", f"Bearer {security.token}"),) if security.token else ()
        target = (
            f"{address.host}:{address.port}"
            if ":" not in address.host
            else f"[{address.host}]:{address.port}"
        )
        options = message_options(Limits().max_chunk_bytes)
        if address.scheme == "grpcs":
            credentials = grpc_channel_credentials(security.tls or TlsFiles())
            self._channel = grpc.aio.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._stub = pb_grpc.TensorServiceStub(self._channel)  # type: ignore[no-untyped-call]
        # Put and Get pass raw bytes: wire.rpc encodes and parses their chunks without copies.
        self._put_call = self._channel.stream_unary(f"/{SERVICE}/Put", None, pb.PutReply.FromString)
        self._get_call = self._channel.unary_stream(f"/{SERVICE}/Get", _serialize, None)
        self._part_call = self._channel.stream_unary(
            f"/{SERVICE}/PublishPart", None, pb.GenerationInfo.FromString
        )
        self._ranges_call = self._channel.unary_stream(f"/{SERVICE}/GetRanges", _serialize, None)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def open(self, timeout: float) -> None:
        """Wait until the channel is connected; ConnectError/TransferTimeout otherwise."""
        try:
            await within(self._stub.Ping(pb.Empty(), timeout=timeout, metadata=self._metadata), timeout)
        except TimeoutError as exc:
            await self.close()
            raise TransferTimeout(f"connecting to {self.address}: no answer within {timeout:.3g}s") from exc
        except grpc.aio.AioRpcError as exc:
            await self.close()
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise ConnectError(f"cannot connect to {self.address}: {exc.details()}") from exc
            raise self._translate(exc, "ping") from exc

    # -- operations ----------------------------------------------------------------------------
    async def put(self, batch: PutBatch, progress: Progress | None = None) -> int:
        reply = await self._unary(
            "put",
            self._put_call(self._chunks(batch, progress), timeout=self.timeout, metadata=self._metadata),
        )
        return int(reply.version)

    async def _chunks(
        self, batch: PutBatch, progress: Progress | None, part: pb.PartHead | None = None
    ) -> AsyncIterator[bytes]:
        """The batch's tensors as Chunk messages (``part``: a PublishPart's head, on the first)."""
        kind = self._kind
        for index in range(batch.parts):
            metas, views = batch.part(index)
            for meta, view in zip(metas, views, strict=True):
                header: pb.TensorInfo | None = info_of(meta)  # rides on the tensor's first chunk
                for start in range(0, max(view.nbytes, 1), self._chunk):
                    data = view[start : start + self._chunk]
                    yield encode_chunk(data, kind, checksum(kind, data), header, part)  # the one copy
                    header, part = None, None
                    if progress is not None:
                        progress(len(data))

    async def get(
        self, names: Sequence[str], sink: Sink, progress: Progress | None = None
    ) -> list[TensorMeta]:
        request = pb.GetRequest(names=names, chunk_bytes=self._get_chunk, checksum_kind=pb_kind(self._kind))
        call = self._get_call(request, timeout=self.timeout, metadata=self._metadata)
        try:
            return await self._land(call, sink, progress)
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc, "get") from exc
        finally:
            call.cancel()  # a no-op when the stream is done; stops it if landing failed

    # -- generations: what ``tensorwire.sharded`` needs (PartPublisher, RangedGenerations) ------
    async def publish_part(
        self, prefix: str, batch: PutBatch, *, txn: bytes, index: int, count: int, timeout: float
    ) -> Generation:
        ms = max(1, min(round(timeout * 1000), 0xFFFFFFFF))
        head = part_info(wg.PartHead(prefix, txn, index, count, ms))
        # The server answers once every part is in, or at ``timeout``; this deadline only backs it up.
        call = self._part_call(
            self._chunks(batch, None, head), timeout=timeout + self.timeout, metadata=self._metadata
        )
        what = f"part {index} of {count} of a publish under {prefix!r}"
        return generation_of(await self._unary(what, call))

    async def get_ranges_at(self, name: str, at: int, ranges: Sequence[tuple[int, memoryview]]) -> int:
        total = sum(dest.nbytes for _, dest in ranges)
        numbers: list[int] = []

        def sink(metas: list[TensorMeta]) -> list[memoryview]:
            if len(metas) != 1 or metas[0].nbytes != total or metas[0].name != name:
                raise ProtocolError(f"{self.address} answered ranges of {name!r} with something else")
            numbers.append(metas[0].version)
            return [dest for _, dest in ranges]

        request = pb.RangesRequest(
            name=name,
            at=at,
            offsets=[o for o, _ in ranges],
            lengths=[d.nbytes for _, d in ranges],
            chunk_bytes=self._get_chunk,
            checksum_kind=pb_kind(self._kind),
        )
        call = self._ranges_call(request, timeout=self.timeout, metadata=self._metadata)
        try:
            await self._land(call, sink, None)
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc, f"get of {len(ranges)} ranges of {name!r}") from exc
        finally:
            call.cancel()
        return numbers[-1]

    async def manifest(self, prefix: str, at: int) -> GenerationManifest:
        request = pb.ManifestRequest(prefix=prefix, at=at)
        what = f"manifest of {prefix!r} at generation {at or 'latest'}"
        call = self._stub.Manifest(request, timeout=self.timeout, metadata=self._metadata)
        return manifest_of(await self._unary(what, call))

    async def lease(self, prefix: str, number: int, seconds: float) -> tuple[float, int]:
        ms = min(round(seconds * 1000), 0xFFFFFFFF)
        request = pb.LeaseRequest(prefix=prefix, number=number, milliseconds=ms)
        call = self._stub.Lease(request, timeout=self.timeout, metadata=self._metadata)
        reply = await self._unary(f"lease on generation {number} of {prefix!r}", call)
        return reply.granted_ms / 1000, int(reply.oldest)

    async def _land(self, call: Any, sink: Sink, progress: Progress | None) -> list[TensorMeta]:
        chunks = call.__aiter__()
        try:
            head = decode_chunk(await chunks.__anext__())
        except StopAsyncIteration:
            raise ProtocolError(f"{self.address} answered a Get with no manifest") from None
        metas = [meta_of(info) for info in head.manifest]
        targets = [b for b in sink(metas) if b.nbytes]
        index, filled = 0, 0
        async for raw in chunks:
            chunk = decode_chunk(raw)
            data = chunk.data
            if checksum(chunk.kind or ChecksumKind.XXH3_64, data) != chunk.checksum:
                raise CorruptFrame(f"a chunk from {self.address} failed its checksum")
            pos = 0
            while pos < len(data):  # a chunk may end one tensor and start the next
                if index >= len(targets):
                    raise ProtocolError(f"{self.address} sent more bytes than its manifest holds")
                take = min(len(data) - pos, targets[index].nbytes - filled)
                targets[index][filled : filled + take] = data[pos : pos + take]
                pos, filled = pos + take, filled + take
                if filled == targets[index].nbytes:
                    index, filled = index + 1, 0
            if progress is not None:
                progress(len(data))
        if index != len(targets):
            raise ProtocolError(f"{self.address} ended a Get before all its bytes arrived")
        return metas

    async def delete(self, names: Sequence[str]) -> int:
        reply = await self._unary(
            "delete",
            self._stub.Delete(pb.NamesRequest(names=names), timeout=self.timeout, metadata=self._metadata),
        )
        return int(reply.deleted)

    async def stat(self, names: Sequence[str]) -> list[TensorMeta]:
        reply = await self._unary(
            "stat",
            self._stub.Stat(pb.NamesRequest(names=names), timeout=self.timeout, metadata=self._metadata),
        )
        return [meta_of(info) for info in reply.tensors]

    async def list(self, prefix: str, limit: int) -> list[TensorMeta]:
        request = pb.ListRequest(prefix=prefix, limit=limit)
        reply = await self._unary(
            "list", self._stub.List(request, timeout=self.timeout, metadata=self._metadata)
        )
        return [meta_of(info) for info in reply.tensors]

    async def ping(self) -> None:
        await self._unary("ping", self._stub.Ping(pb.Empty(), timeout=self.timeout, metadata=self._metadata))

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._channel.close()

    # -- errors --------------------------------------------------------------------------------
    async def _unary(self, what: str, call: Any) -> Any:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            raise self._translate(exc, what) from exc

    def _translate(self, exc: grpc.aio.AioRpcError, what: str) -> TensorwireError:
        """The tensorwire error for a failed call (foreign exceptions stop at this boundary)."""
        for key, value in exc.trailing_metadata() or ():
            if key == ERROR_KEY and str(value).isdigit():
                return error_for_code(int(value), exc.details() or "")
        code = exc.code()
        if code == grpc.StatusCode.INTERNAL and _LOST_STATUS in (exc.debug_error_string() or ""):
            # grpc/grpc#36066: a server that ends a streamed call (a put it refused) while a
            # message is being sent has its status overwritten by this one. Sent again, the call
            # most likely meets the refusal at its first message and reports it.
            return ConnectionLost(f"{what} to {self.address} was ended by the server while being sent; "
                                  "gRPC lost the server's status")  # fmt: skip
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self._closed = True
            return TransferTimeout(
                f"waited {self.timeout:.3g}s for the answer to the {what} from {self.address}"
            )
        if code in _TRANSIENT:
            self._closed = True
            return ConnectionLost(f"{what} to {self.address} failed: {exc.details()}")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return LimitExceeded(f"{what} to {self.address}: {exc.details()}")
        return ServerError(f"{what} to {self.address} failed with {code.name}: {exc.details()}")


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


async def open_transport(address: Address, options: TransportOptions) -> RpcTransport:
    transport = RpcTransport(
        address, options.checksum, options.chunk_size, options.request_timeout, options.security
    )
    await transport.open(options.connect_timeout)
    return transport
