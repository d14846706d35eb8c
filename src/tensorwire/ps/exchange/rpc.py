"""The gradient exchange over gRPC: ``train.GradientService/UpdateGradient``.

Any client generated from proto/tensorwire/v1/gradient_service.proto speaks it: float32 bytes in
and out, the worker id, step, tensor name (and optionally the world size) in call metadata, and
optionally its ``session`` (see ``ps/exchange/server.py`` for who owns a rank) and, for a
compressed gradient, ``codec`` and ``numel``. A call with none of worker id, step and tensor name
is a one-worker exchange when the server's world is 1 (``--workers``, the default): its answer is
its own gradient. Each call is one gradient of one (step, tensor) round of the server's
``GradientExchange``, whose capacity holds the call's decoded gradient and its answer until the
call is over; errors go back as gRPC status codes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from typing import Any

import grpc
import torch

from tensorwire.compression import Codec
from tensorwire.compression.codecs import from_wire
from tensorwire.errors import (
    CapacityExceeded,
    InvalidTensor,
    LimitExceeded,
    ProtocolError,
    TensorwireError,
    TransferTimeout,
)
from tensorwire.ps.exchange.server import GradientExchange, check_identity, host_of
from tensorwire.v1 import gradient_service_pb2 as pb
from tensorwire.wire.rpc import UNARY_MAX_BYTES

__all__ = ["IDENTITY_KEYS", "SESSION_KEY", "rpc_handler"]

# The call metadata that places a gRPC gradient in a round (world-size is optional).
IDENTITY_KEYS = ("worker-id", "step", "tensor-name")
SESSION_KEY = "session"  # optional call metadata: the caller's session (else its connection)


def rpc_handler(exchange: GradientExchange) -> grpc.GenericRpcHandler:
    """``train.GradientService`` served by ``exchange`` (a ``ParamServer`` adds it to its server)."""
    # The request arrives as raw bytes and is parsed in a worker thread (``_gradient_of``).
    method = grpc.unary_unary_rpc_method_handler(
        _GradientService(exchange).update_gradient,
        request_deserializer=None,
        response_serializer=pb.GradientResponse.SerializeToString,
    )
    return grpc.method_handlers_generic_handler("train.GradientService", {"UpdateGradient": method})


class _GradientService:
    """UpdateGradient's calls, each put in its round of ``exchange``."""

    def __init__(self, exchange: GradientExchange) -> None:
        self.exchange = exchange

    async def update_gradient(self, raw: bytes, context: Any) -> pb.GradientResponse:
        exchange = self.exchange
        try:
            metadata = context.invocation_metadata() or ()
            identity = _call_metadata(metadata, exchange.default_world)
            session = _rpc_session(metadata, context)
            if identity is not None:
                exchange.check_owner(identity[0], session)
            grad = await self._gradient_of(raw, metadata)
            self._hold_answer(context, 4 * grad.numel())
            if identity is None:  # a one-worker exchange: the mean is the gradient
                return pb.GradientResponse(updated_gradient=grad.numpy().tobytes())
            remaining = context.time_remaining()
            wait = (
                exchange.wait_timeout
                if remaining is None
                else min(exchange.wait_timeout, max(remaining - 0.05, 0))
            )
            mean, _ = await exchange.contribute(*identity, grad, wait=wait, session=session)
        except TensorwireError as exc:
            await context.abort(_grpc_code(exc), str(exc))
            raise AssertionError("unreachable: abort raises") from exc
        return pb.GradientResponse(updated_gradient=mean.numpy().tobytes())

    def _hold_answer(self, context: Any, nbytes: int) -> None:
        """grpcio keeps a call's answer until the peer has read it, which a peer may never do: its
        bytes count against the capacity until the call is over (refused up front if they cannot)."""
        self.exchange.charge(nbytes, "a gRPC answer")
        released = False

        def release(_: object) -> None:
            nonlocal released
            if not released:
                released = True
                self.exchange.count(-nbytes)

        context.add_done_callback(release)

    async def _gradient_of(self, raw: bytes, metadata: Sequence[tuple[str, Any]]) -> torch.Tensor:
        """The float32 gradient a gRPC call carries: raw, or in the codec its metadata names (with
        ``numel``, which a payload's size does not always tell). Its decoded size is checked
        against the capacity (and the largest answer a message can carry) before it is made."""
        values = {key: value for key, value in metadata if isinstance(value, str)}
        codec = from_wire(values.get("codec"))
        numel = len(raw) // 4  # at most: the message also has its field's key and length
        if codec is not None:
            text = values.get("numel", "")
            if not (text.isascii() and text.isdigit()) or len(text) > 19:
                raise ProtocolError("a compressed gradient needs the call metadata numel (its element count)")
            numel = int(text)
        if 4 * numel > UNARY_MAX_BYTES:
            raise LimitExceeded(
                f"a gradient of {numel} elements: its float32 answer would exceed the {UNARY_MAX_BYTES}-byte "
                "gRPC message limit"
            )
        size = 4 * numel + len(raw)  # the tensor, and the parsed copy of the payload
        self.exchange.charge(size, "a gRPC gradient")
        try:
            return await asyncio.to_thread(_decode_request, raw, codec, numel)
        finally:
            self.exchange.count(-size)  # the exchange charges the gradient if it joins a round


def _rpc_session(metadata: Sequence[tuple[str, Any]], context: Any) -> Hashable:
    """Who makes a gRPC call: its ``session`` metadata, else the host it comes from (not its
    connection: a channel reconnects when the server closes an idle connection)."""
    for key, value in metadata:
        if key == SESSION_KEY and isinstance(value, str) and value:
            return ("session", value[:128])
    return ("host", host_of(str(context.peer())))


def _decode_request(raw: bytes, codec: Codec | None, numel: int) -> torch.Tensor:
    """Parse a ``GradientRequest`` and decode its gradient (in a worker thread)."""
    try:
        data: bytes = pb.GradientRequest.FromString(raw).gradient
    except Exception as exc:  # protobuf's DecodeError
        raise ProtocolError(f"a malformed GradientRequest: {exc}") from None
    if codec is None:
        if len(data) % 4:
            raise InvalidTensor(f"gradient of {len(data)} bytes is not float32 data")
        return torch.frombuffer(bytearray(data), dtype=torch.float32) if data else torch.empty(0)
    if codec.payload_bytes(numel) != len(data):
        raise InvalidTensor(f"a {codec.name} gradient of {numel} elements is not {len(data)} bytes")
    payload = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    )
    return codec.decode(payload, torch.empty(numel))


def _call_metadata(
    metadata: Sequence[tuple[str, Any]], default_world: int
) -> tuple[int, int, int, str] | None:
    """(worker-id, world-size, step, tensor-name) from a call's metadata, checked; None for a call
    that sends none of worker-id, step and tensor-name to a one-worker world."""
    values = {key: value for key, value in metadata if isinstance(value, str)}
    try:
        world = int(values.get("world-size", "0") or "0") or default_world
    except ValueError:
        raise ProtocolError(f"world-size must be a whole number, not {values['world-size'][:32]!r}") from None
    missing = [k for k in IDENTITY_KEYS if k not in values]
    if len(missing) == len(IDENTITY_KEYS):
        if world == 1:
            return None
        raise ProtocolError(
            f"UpdateGradient without call metadata is a one-worker exchange, but this one has "
            f"{world or 'no default'} workers (world-size, or the server's --workers): send the call "
            f"metadata {', '.join(IDENTITY_KEYS)} (and world-size) with each gradient"
        )
    if missing:
        raise ProtocolError(f"UpdateGradient needs call metadata {', '.join(missing)}")
    try:
        worker, step = int(values["worker-id"]), int(values["step"])
    except ValueError as exc:
        raise ProtocolError(f"worker-id and step must be whole numbers: {str(exc)[:80]}") from None
    name = values["tensor-name"]
    check_identity(worker, world, step, name)
    return worker, world, step, name


def _grpc_code(exc: TensorwireError) -> grpc.StatusCode:
    if isinstance(exc, TransferTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, (LimitExceeded, CapacityExceeded)):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, (ProtocolError, InvalidTensor, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL
