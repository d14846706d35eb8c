"""The gRPC face of a tensorwire server: ``TensorService`` over the same ``TensorStore``.

``UploadTensor`` / ``DownloadTensor`` keep the interface that existing clients of this kind of
service speak: one message per tensor, failures answered with ``success=false`` and a readable
message. ``Put`` / ``Get`` stream tensors of any size in checksummed chunks (what
``tensorwire.connect("grpc://...")`` uses); a put becomes visible only when every chunk of every
tensor was verified, all tensors at once. Failures of the streaming calls are gRPC errors that
carry the tensorwire error code in the trailing metadata key ``tensorwire-error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from tensorwire.errors import (
    ConnectError,
    ErrorCode,
    InvalidTensor,
    LimitExceeded,
    ProtocolError,
    TensorwireError,
)
from tensorwire.logs import event
from tensorwire.security import TlsFiles, grpc_server_credentials, tokens_match
from tensorwire.server.generation_ops import GenerationOps
from tensorwire.server.metrics import RequestCounts
from tensorwire.server.rpc_calls import (
    StreamedPut,
    Watchdog,
    abort,
    answer,
    checked_chunk,
    off_loop,
    read_options,
    ready,
    serialize,
)
from tensorwire.server.rpc_generations import GenerationCalls
from tensorwire.store import Reservation, TensorStore
from tensorwire.transport.base import Listener
from tensorwire.types import Address, Limits, TensorMeta
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.v1 import tensor_service_pb2_grpc as pb_grpc
from tensorwire.wire.dtypes import dtype_from_name, dtype_name
from tensorwire.wire.names import validate_prefix
from tensorwire.wire.rpc import (
    ERROR_KEY,
    SERVICE,
    UNARY_MAX_BYTES,
    info_of,
    message_options,
)

log = logging.getLogger("tensorwire.server")
T = TypeVar("T")


class TensorServicer(pb_grpc.TensorServiceServicer):
    """``TensorService`` on one store."""

    def __init__(self, store: TensorStore, limits: Limits, stall_timeout: float = 60.0) -> None:
        self.store = store
        self.limits = limits
        # A call that makes no progress for this long mid-stream is ended and what it holds freed.
        self.stall_timeout = stall_timeout

    # -- the interface existing clients speak -------------------------------------------------
    # Their messages hold a whole tensor: they arrive and leave as raw bytes (see ``handlers``) and
    # are parsed, copied and serialized in a worker thread, not on the loop that serves the others.
    async def UploadTensor(self, raw: bytes, context: Any) -> pb.TensorResponse:
        res: Reservation | None = None
        try:
            request = await off_loop(len(raw), _parse, pb.TensorRequest, raw)
            meta = TensorMeta(
                request.tensor_name, dtype_from_name(request.dtype), tuple(request.shape), len(request.data)
            )
            try:
                meta.check_size()
            except InvalidTensor as exc:
                raise InvalidTensor(f"shape/data size mismatch: {exc}") from None
            res = self.store.reserve([meta])
            await off_loop(meta.nbytes, res.buffers[0].__setitem__, slice(None), request.data)
            version = await self._commit(res)
        except TensorwireError as exc:
            return pb.TensorResponse(success=False, message=str(exc))
        finally:
            if res is not None:
                self.store.abort(res)  # a no-op once committed
        return pb.TensorResponse(success=True, message=f"stored {meta.name!r} at version {version}")

    async def DownloadTensor(self, request: pb.TensorRequest, context: Any) -> bytes:
        try:
            (entry,) = self.store.acquire([request.tensor_name])
        except TensorwireError as exc:
            return serialize(pb.TensorResponse(success=False, message=str(exc)))
        try:
            meta = entry.meta
            if meta.nbytes > UNARY_MAX_BYTES:
                message = f"{meta.name!r} has {meta.nbytes} bytes: too large for DownloadTensor, use Get"
                return serialize(pb.TensorResponse(success=False, message=message))
            # grpcio keeps the answer until the peer has read it, which a peer may never do: the
            # copy counts against the capacity until the call is over, like a put's bytes.
            try:
                release = self.store.hold(meta.nbytes)
            except TensorwireError as exc:
                return serialize(pb.TensorResponse(success=False, message=str(exc)))
            context.add_done_callback(lambda _: release())
            try:
                return await off_loop(meta.nbytes, _tensor_response, entry.data, meta)
            except BaseException:
                release()
                raise
        finally:
            self.store.release([entry])

    # -- streaming and the other operations ---------------------------------------------------
    async def Put(self, request_iterator: AsyncIterator[bytes], context: Any) -> pb.PutReply:
        """Chunks arrive as raw wire bytes (see ``handlers``) and are parsed in place."""
        return await answer(context, lambda: self._put(request_iterator))

    async def _put(self, chunks: AsyncIterator[bytes]) -> pb.PutReply:
        batch = Reservation()
        watchdog = Watchdog(self.stall_timeout)
        try:
            await StreamedPut(self.store, self.limits, batch, watchdog).receive(chunks)
            watchdog.close()
            return pb.PutReply(version=await self._commit(batch))
        except asyncio.CancelledError:
            if not watchdog.fired:
                raise
            raise watchdog.cut_off() from None
        finally:
            watchdog.close()
            self.store.abort(batch)  # a no-op once committed

    async def Get(self, request: pb.GetRequest, context: Any) -> AsyncIterator[bytes]:
        """Answers with raw wire bytes of ``Chunk`` messages (see ``handlers``). A client that
        stops reading for the stall timeout is cut off, and the tensors it pinned are released."""
        names = list(request.names)
        if not names or len(names) > self.limits.max_batch or len(set(names)) != len(names):
            await abort(context, ProtocolError(f"Get asks for {len(names)} tensors, or one twice"))
        chunk, kind = await read_options(request, self.limits, context)
        try:
            entries = self.store.acquire(names)
        except TensorwireError as exc:
            await abort(context, exc)
        watchdog = Watchdog(self.stall_timeout)
        try:
            yield pb.Chunk(manifest=[info_of(e.meta) for e in entries]).SerializeToString()
            for entry in entries:
                for start in range(0, entry.meta.nbytes, chunk):
                    watchdog.progress()
                    data = entry.data[start : start + chunk]
                    yield await off_loop(len(data), checked_chunk, data, kind)  # the one copy grpcio needs
        finally:
            watchdog.close()
            self.store.release(entries)

    async def Delete(self, request: pb.NamesRequest, context: Any) -> pb.DeleteReply:
        names = await self._names(request, context)

        async def run() -> pb.DeleteReply:
            # On the store's disk thread when it has a data directory: a delete waits there for a
            # commit's disk write, and the loop goes on serving the others meanwhile.
            return pb.DeleteReply(deleted=await self.store.call(self.store.delete, names))

        return await answer(context, run)

    async def Stat(self, request: pb.NamesRequest, context: Any) -> pb.TensorList:
        names = await self._names(request, context)
        return await answer(
            context, lambda: ready(pb.TensorList(tensors=map(info_of, self.store.stat(names))))
        )

    async def _names(self, request: pb.NamesRequest, context: Any) -> list[str]:
        """The names a request lists, at most ``max_batch`` of them (as the frame protocol's)."""
        if len(request.names) > self.limits.max_batch:
            await abort(context, LimitExceeded(f"{len(request.names)} names exceed {self.limits.max_batch}"))
        return list(request.names)

    async def List(self, request: pb.ListRequest, context: Any) -> pb.TensorList:
        limit = min(request.limit or self.limits.max_batch, self.limits.max_batch)

        async def run() -> pb.TensorList:
            validate_prefix(request.prefix)
            return pb.TensorList(tensors=map(info_of, self.store.list(request.prefix, limit)))

        return await answer(context, run)

    async def Ping(self, request: pb.Empty, context: Any) -> pb.Empty:
        return pb.Empty()

    async def _commit(self, res: Reservation) -> int:
        if self.store.persistent:  # the disk write blocks; keep the loop serving others
            return await asyncio.get_running_loop().run_in_executor(None, self.store.commit, res)
        return self.store.commit(res)


def _parse(message: Any, raw: bytes) -> Any:
    try:
        return message.FromString(raw)
    except DecodeError as exc:
        raise ProtocolError(f"a malformed {message.DESCRIPTOR.name}: {exc}") from None


def _tensor_response(data: memoryview, meta: TensorMeta) -> bytes:
    """The wire bytes of a DownloadTensor answer, built in a worker thread for a large tensor."""
    response = pb.TensorResponse(
        success=True, data=bytes(data), shape=meta.shape, dtype=dtype_name(meta.dtype)
    )
    return serialize(response)


class RpcListener(Listener):
    """A running ``grpc.aio`` server; ``address`` is the real one (port 0 resolved)."""

    def __init__(self, server: Any, address: Address) -> None:
        self._server = server
        self.address = address

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._server.stop(grace=0.5)


def handlers(servicer: TensorServicer, generations: GenerationCalls | None = None) -> Any:
    """The method table of ``TensorService`` (what the generated ``add_..._to_server`` builds),
    except that Put's requests and Get's answers pass as raw bytes: ``wire.rpc`` encodes and
    parses their chunks without the copies the generated message class would make; and the
    whole-tensor messages of UploadTensor and DownloadTensor pass as raw bytes so that they are
    parsed and built off the event loop."""
    unary = grpc.unary_unary_rpc_method_handler
    methods = {
        "UploadTensor": unary(servicer.UploadTensor, None, serialize),
        "DownloadTensor": unary(servicer.DownloadTensor, pb.TensorRequest.FromString, None),
        "Put": grpc.stream_unary_rpc_method_handler(servicer.Put, None, serialize),
        "Get": grpc.unary_stream_rpc_method_handler(servicer.Get, pb.GetRequest.FromString, None),
        "Delete": unary(servicer.Delete, pb.NamesRequest.FromString, serialize),
        "Stat": unary(servicer.Stat, pb.NamesRequest.FromString, serialize),
        "List": unary(servicer.List, pb.ListRequest.FromString, serialize),
        "Ping": unary(servicer.Ping, pb.Empty.FromString, serialize),
    }
    # The parts' chunks and the ranges' answers pass as raw bytes, as Put's and Get's do.
    if generations is not None:
        methods |= {
            "PublishPart": grpc.stream_unary_rpc_method_handler(generations.PublishPart, None, serialize),
            "GetRanges": grpc.unary_stream_rpc_method_handler(
                generations.GetRanges, pb.RangesRequest.FromString, None
            ),
            "Manifest": unary(generations.Manifest, pb.ManifestRequest.FromString, serialize),
            "Lease": unary(generations.Lease, pb.LeaseRequest.FromString, serialize),
        }
    return grpc.method_handlers_generic_handler(SERVICE, methods)


class TokenGate(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call that does not carry ``authorization: Bearer <token>`` (compared in
    constant time), with UNAUTHENTICATED and the tensorwire code in the trailers, before any
    handler (and so any store operation) runs.

    The gate sees a call's method and metadata before grpcio reads its request message, and the
    refusal it answers with reads no message at all: a token-less call of any size costs the
    server no more than its headers (grpcio buffers no more of the body than HTTP/2 flow control
    lets the client send before the refusal ends the stream)."""

    def __init__(self, token: str, counts: RequestCounts | None = None) -> None:
        self._token = token
        self._counts = counts

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        offered = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
                offered = value.removeprefix("Bearer ")
        if tokens_match(self._token, offered):
            return await continuation(details)
        why = "no token was offered" if offered is None else "the token is wrong"
        if self._counts is not None:
            self._counts.refuse("auth")
        event(
            log, logging.WARNING, "call refused", method=op_of(details.method), reason=why, transport="grpc"
        )
        return _refusal(f"authentication failed: {why}")


# The methods served, by path -> the operation names the frame protocol's metrics use. A metric
# label never takes a value a peer chose: any other path counts as "unknown".
_RPC_OPS = {
    **{f"/{SERVICE}/{method}": op for method, op in (
        ("UploadTensor", "put"), ("DownloadTensor", "get"), ("Put", "put"), ("Get", "get"),
        ("Delete", "delete"), ("Stat", "stat"), ("List", "list"), ("Ping", "ping"),
        ("PublishPart", "gen_publish_part"), ("GetRanges", "gen_get_ranges"),
        ("Manifest", "gen_manifest"), ("Lease", "gen_lease"),
    )},
    "/train.GradientService/UpdateGradient": "allreduce",
}  # fmt: skip


def op_of(method: object) -> str:
    """The metric label (and log field) of a gRPC method path: one of a fixed set."""
    return _RPC_OPS.get(method, "unknown") if isinstance(method, str) else "unknown"


class Counting(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Counts every call in the server's ``RequestCounts`` (metrics.py): the request, its bytes
    each way (as the messages' lengths), whether it ended in an error, and calls in flight. A call
    to a method the server does not serve is counted as one failed "unknown" request."""

    def __init__(self, counts: RequestCounts, transport: str) -> None:
        self._counts = counts
        self._transport = transport

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        op = op_of(details.method)
        if handler is None:
            row = self._counts.begin(op, self._transport)
            self._counts.end(row, 0, True)
            return None
        return _counted(handler, self._counts, self._transport, op)


def _counted(handler: Any, counts: RequestCounts, transport: str, op: str) -> Any:
    """``handler`` with its behaviour wrapped to count the call, and its (de)serializers to count bytes."""
    kind = "stream_unary" if handler.request_streaming else "unary_unary"
    if handler.response_streaming:
        kind = "stream_stream" if handler.request_streaming else "unary_stream"
    behaviour = getattr(handler, kind)
    row = counts.row(op, transport)  # bytes are counted as messages pass, calls in the behaviour

    def received(raw: bytes) -> Any:
        row.received += len(raw)
        return handler.request_deserializer(raw) if handler.request_deserializer else raw

    def sent(message: Any) -> bytes:
        raw: bytes = handler.response_serializer(message) if handler.response_serializer else message
        row.sent += len(raw)
        return raw

    if inspect.isasyncgenfunction(behaviour):

        async def streamed(request: Any, context: Any) -> Any:
            started = time.perf_counter()
            counts.begin(op, transport)
            failed = True
            try:
                async for item in behaviour(request, context):
                    yield item
                failed = False
            finally:
                counts.end(row, 0, failed, time.perf_counter() - started)

        wrapped: Any = streamed
    else:

        async def called(request: Any, context: Any) -> Any:
            started = time.perf_counter()
            counts.begin(op, transport)
            failed = True
            try:
                result = await behaviour(request, context)
                failed = False
                return result
            finally:
                counts.end(row, 0, failed, time.perf_counter() - started)

        wrapped = called
    return handler._replace(**{kind: wrapped, "request_deserializer": received, "response_serializer": sent})


def _refusal(message: str) -> Any:
    """A handler that answers UNAUTHENTICATED without reading the request. It is a stream handler
    whatever the method is: grpcio reads a unary call's whole message (up to the largest message
    the server accepts) before the handler runs, and a stream's only when the handler asks."""

    async def refuse(requests: Any, context: Any) -> None:
        context.set_trailing_metadata(((ERROR_KEY, str(int(ErrorCode.UNAUTHENTICATED))),))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return grpc.stream_unary_rpc_method_handler(refuse, None, None)


async def listen(
    address: Address,
    store: TensorStore,
    limits: Limits,
    *,
    tls: TlsFiles | None = None,
    token: str | None = None,
    stall_timeout: float = 60.0,
    extra_handlers: Sequence[grpc.GenericRpcHandler] = (),
    counts: RequestCounts | None = None,
    max_connections: int = 1024,
    auth_timeout: float = 5.0,
    idle_timeout: float = 900.0,
    generations: GenerationOps | None = None,
) -> RpcListener:
    """Serve ``TensorService`` for ``store`` on ``address`` (``grpc://host:0`` picks a free port;
    ``grpcs://`` serves TLS with ``tls``' files; a ``token`` is then required on every call).

    Connections are bounded as on the frame protocol's listeners: at most ``max_connections``
    (counted from accept, TLS handshakes included); one that has not finished its TLS handshake
    and HTTP/2 preface within ``auth_timeout`` is closed; one with no call in flight is closed
    after ``idle_timeout``, or after ``auth_timeout`` when a token is required, since a gRPC
    server cannot tell a connection whose calls were refused from one whose calls were let in
    (clients reconnect on their next call without noticing). With ``generations`` (the server's
    ``GenerationOps``) it serves the generation calls too (rpc_generations.py)."""
    interceptors: list[Any] = [TokenGate(token, counts)] if token is not None else []
    if counts is not None:  # after the gate: a refused call runs no handler, so it is no request
        interceptors.append(Counting(counts, address.scheme))
    idle = idle_timeout if token is None else min(idle_timeout, auth_timeout)
    # so_reuseport off: a port in use is an error, not silently shared with another server.
    options = [
        *message_options(limits.max_chunk_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", limits.max_inflight),  # per connection
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", max(int(auth_timeout * 1000), 1)),
        ("grpc.max_connection_idle_ms", max(int(idle * 1000), 1)),
    ]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    calls = None
    if generations is not None:
        calls = GenerationCalls(generations, limits, stall_timeout, max_peers=max_connections)
    service = handlers(TensorServicer(store, limits, stall_timeout), calls)
    server.add_generic_rpc_handlers((service, *extra_handlers))
    host = f"[{address.host}]" if ":" in address.host else address.host
    try:
        if tls is not None:
            port = server.add_secure_port(f"{host}:{address.port}", grpc_server_credentials(tls))
        else:
            port = server.add_insecure_port(f"{host}:{address.port}")
    except RuntimeError as exc:  # grpcio raises where older versions returned 0
        raise ConnectError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise ConnectError(f"cannot listen on {address}")
    await server.start()
    listener = RpcListener(server, Address(address.scheme, address.host, port))
    listener.encrypted = tls is not None
    return listener


__all__ = ["TensorServicer", "listen"]
