"""Gradient exchange: the average of N data-parallel workers' gradients, per step and tensor.

For training code that keeps its optimizer local and wants an ``allreduce`` of its gradients
without ``torch.distributed``: each worker sends its gradient for (step, tensor name) and gets
back the mean over the live workers of that step, once every one of them has sent. The sum runs in
worker order, so every worker gets bit-identical numbers and a rerun gives the same ones.

Served two ways by every parameter server (``tensorwire ps serve``):

* the frame protocol's ``ALLREDUCE`` (many tensors of one step in one request), which
  ``ExchangeClient`` speaks over tcp://, tls:// and memory://;
* gRPC ``train.GradientService/UpdateGradient`` (proto/tensorwire/v1/gradient_service.proto), which
  any client generated from that schema speaks: float32 bytes in and out, the worker id, step,
  tensor name (and optionally the world size) in call metadata.

Either way a worker may send its gradient compressed (tensorwire.compression): ALLREDUCE names
the codec after its records, gRPC callers add ``codec`` and ``numel`` to the call metadata. The
server decodes each gradient once, on arrival; the means go back in full precision (float32 on
gRPC), so every worker still gets the same bits.

"Live": a worker that leaves (``PS_LEAVE``, sent by ``ExchangeClient.close``) no longer counts,
so workers with uneven amounts of data finish without waiting for each other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from tensorwire.compression import decode_all, from_wire, payload_total
from tensorwire.errors import (
    CapacityExceeded,
    InvalidTensor,
    ProtocolError,
    TensorwireError,
    TransferTimeout,
    WaitTimeout,
)
from tensorwire.server import Request
from tensorwire.store.names import validate_name
from tensorwire.types import TensorMeta
from tensorwire.v1 import gradient_service_pb2 as pb
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.tensors import byte_view, empty_for

log = logging.getLogger("tensorwire.ps.exchange")
MAX_WORLD = 1 << 16


@dataclass(eq=False)
class _Round:
    """One (step, tensor) being averaged."""

    world: int
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    result: asyncio.Future[tuple[torch.Tensor, int]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class GradientExchange:
    """The server side: rounds keyed by (step, tensor name); see the module doc."""

    def __init__(self, workers: int = 0, wait_timeout: float = 120.0, capacity: int = 1 << 62) -> None:
        self.default_world = workers  # for gRPC callers that send no world-size
        self.wait_timeout = wait_timeout
        self.capacity = capacity  # most bytes of gradients open rounds may hold
        self.held = 0
        self.left: set[int] = set()
        self.rounds_done = 0
        self._rounds: dict[tuple[int, str], _Round] = {}
        self._done: dict[str, int] = {}  # the last step averaged, per tensor
        self._last_world = 0

    async def contribute(
        self, worker: int, world: int, step: int, name: str, grad: torch.Tensor, *, wait: float | None = None
    ) -> tuple[torch.Tensor, int]:
        """Add ``grad`` to its round; return (the mean, how many workers it averages)."""
        world = world or self.default_world
        _check_rank(worker, world)
        if not 0 <= step < 1 << 63:
            raise ProtocolError(f"step {step} is out of range")
        if step <= self._done.get(name, -1):
            raise ProtocolError(f"step {step} of {name!r} was already averaged without worker {worker}")
        self.left.discard(worker)  # sending again is rejoining
        key = (step, name)
        round_ = self._rounds.get(key)
        if round_ is None:
            round_ = self._rounds[key] = _Round(world)
        _check_like(round_, worker, world, grad, name)
        nbytes = grad.numel() * grad.element_size()
        if self.held + nbytes > self.capacity:
            raise CapacityExceeded(f"open allreduce rounds hold {self.held} bytes; {nbytes} more exceed "
                                   f"{self.capacity}")  # fmt: skip
        round_.grads[worker] = grad
        self.held += nbytes
        self._settle(key, round_)
        # The caller may ask for a shorter wait, never a longer one than the server's own.
        seconds = self.wait_timeout if wait is None else min(wait, self.wait_timeout)
        try:
            return await asyncio.wait_for(asyncio.shield(round_.result), seconds)
        except TimeoutError:
            self._withdraw(key, round_, worker)
            missing = sorted(set(range(round_.world)) - set(round_.grads) - self.left - {worker})[:16]
            raise WaitTimeout(
                f"waited {seconds:.3g}s for the gradients of step {step} of {name!r} from worker(s) "
                f"{', '.join(map(str, missing))}"
            ) from None
        except asyncio.CancelledError:  # the caller went away (a cancelled gRPC call)
            self._withdraw(key, round_, worker)
            raise

    def _withdraw(self, key: tuple[int, str], round_: _Round, worker: int) -> None:
        """The worker gets an error, so its gradient does not count: take it out of the round."""
        if round_.result.done():
            return
        grad = round_.grads.pop(worker, None)
        if grad is not None:
            self.held -= grad.numel() * grad.element_size()
        if not round_.grads and self._rounds.get(key) is round_:
            del self._rounds[key]

    def leave(self, worker: int) -> None:
        """``worker`` is done: rounds stop waiting for it. Once every worker of a world has left,
        the exchange forgets the run (the next one starts again at step 0)."""
        self.left.add(worker)
        for key, round_ in list(self._rounds.items()):
            self._settle(key, round_)
        world = max((r.world for r in self._rounds.values()), default=self._last_world)
        if not self._rounds and world and set(range(world)) <= self.left:
            self.left.clear()
            self._done.clear()

    def _settle(self, key: tuple[int, str], round_: _Round) -> None:
        expected = set(range(round_.world)) - self.left
        if not round_.grads or not expected <= set(round_.grads):
            return
        del self._rounds[key]
        step, name = key
        self._done[name] = max(step, self._done.get(name, -1))
        self._last_world = round_.world
        self.held -= sum(g.numel() * g.element_size() for g in round_.grads.values())
        grads = [round_.grads[w] for w in sorted(round_.grads)]
        mean = grads[0].clone() if len(grads) > 1 else grads[0]
        for grad in grads[1:]:
            mean.add_(grad)
        mean.div_(len(grads))
        self.rounds_done += 1
        round_.result.set_result((mean, len(grads)))

    # -- the frame protocol ---------------------------------------------------------------------
    async def on_allreduce(self, request: Request) -> None:
        head = wps.PsHead.decode(request.meta)
        metas = wm.decode_records(request.meta)
        codec = from_wire(wps.decode_codec(request.meta))
        request.meta.done()
        sent = (
            sum(m.nbytes for m in metas) if codec is None else payload_total(codec, (m.numel for m in metas))
        )
        if sent != request.header.data_len:
            raise InvalidTensor("the records' sizes do not add up to the frame's data length")
        if self.held + request.header.data_len > self.capacity:  # refused before a byte is read
            raise CapacityExceeded(f"{request.header.data_len} more gradient bytes exceed {self.capacity}")
        if len({m.name for m in metas}) != len(metas):
            raise ProtocolError("ALLREDUCE names the same tensor twice")
        for meta in metas:
            validate_name(meta.name)
            if not meta.dtype.is_floating_point:
                raise InvalidTensor(f"{meta.name!r}: only floating-point gradients can be averaged")
        grads = [empty_for(m) for m in metas]
        if codec is None:
            await request.receive([byte_view(g) for g in grads])
        else:
            payloads = [torch.empty(codec.payload_bytes(m.numel), dtype=torch.uint8) for m in metas]
            await request.receive([byte_view(p) for p in payloads])
            decode_all(codec, payloads, grads)
        wait = head.wait_ms / 1000 if head.wait_ms else None
        with request.waiting():
            results = await asyncio.gather(
                *(
                    self.contribute(head.worker, head.world, head.clock, m.name, g, wait=wait)
                    for m, g in zip(metas, grads, strict=True)
                )
            )
        means = [mean for mean, _ in results]
        count = min((n for _, n in results), default=0)
        out = [TensorMeta(m.name, m.dtype, m.shape, m.nbytes) for m in metas]
        await request.reply(wm.encode_records(out) + wps.encode_u32(count), [byte_view(t) for t in means])

    # -- gRPC -----------------------------------------------------------------------------------
    def rpc_handler(self) -> grpc.GenericRpcHandler:
        method = grpc.unary_unary_rpc_method_handler(
            self._update_gradient,
            request_deserializer=pb.GradientRequest.FromString,
            response_serializer=pb.GradientResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler("train.GradientService", {"UpdateGradient": method})

    async def _update_gradient(self, request: pb.GradientRequest, context: Any) -> pb.GradientResponse:
        try:
            metadata = context.invocation_metadata() or ()
            worker, world, step, name = _call_metadata(metadata)
            grad = _gradient_of(request.gradient, metadata)
            remaining = context.time_remaining()
            wait = (
                self.wait_timeout if remaining is None else min(self.wait_timeout, max(remaining - 0.05, 0))
            )
            mean, _ = await self.contribute(worker, world, step, name, grad, wait=wait)
        except TensorwireError as exc:
            await context.abort(_grpc_code(exc), str(exc))
            raise AssertionError("unreachable: abort raises") from exc
        return pb.GradientResponse(updated_gradient=mean.numpy().tobytes())


def _call_metadata(metadata: Sequence[tuple[str, Any]]) -> tuple[int, int, int, str]:
    """(worker-id, world-size or 0, step, tensor-name) from a call's metadata, checked."""
    values = {key: value for key, value in metadata if isinstance(value, str)}
    missing = [k for k in ("worker-id", "step", "tensor-name") if k not in values]
    if missing:
        raise ProtocolError(f"UpdateGradient needs call metadata {', '.join(missing)}")
    try:
        worker, step = int(values["worker-id"]), int(values["step"])
        world = int(values.get("world-size", "0"))
    except ValueError as exc:
        raise ProtocolError(f"worker-id, step and world-size must be whole numbers: {exc}") from None
    if step < 0 or worker < 0 or world < 0:
        raise ProtocolError("worker-id, step and world-size cannot be negative")
    name = values["tensor-name"]
    validate_name(name)
    return worker, world, step, name


def _gradient_of(raw: bytes, metadata: Sequence[tuple[str, Any]]) -> torch.Tensor:
    """The float32 gradient a gRPC call carries: raw, or in the codec its metadata names (with
    ``numel``, which a payload's size does not always tell)."""
    values = {key: value for key, value in metadata if isinstance(value, str)}
    codec = from_wire(values.get("codec"))
    if codec is None:
        if len(raw) % 4:
            raise InvalidTensor(f"gradient of {len(raw)} bytes is not float32 data")
        return torch.frombuffer(bytearray(raw), dtype=torch.float32) if raw else torch.empty(0)
    numel = values.get("numel", "")
    if not numel.isdigit():
        raise ProtocolError("a compressed gradient needs the call metadata numel (its element count)")
    if codec.payload_bytes(int(numel)) != len(raw):
        raise InvalidTensor(f"a {codec.name} gradient of {numel} elements is not {len(raw)} bytes")
    payload = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    )
    return codec.decode(payload, torch.empty(int(numel)))


def _check_rank(worker: int, world: int) -> None:
    if not 0 < world <= MAX_WORLD:
        raise ProtocolError(f"a world of {world} workers (set world-size, or serve with --workers)")
    if not 0 <= worker < world:
        raise ProtocolError(f"worker {worker} is not a rank of a world of {world}")


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


def _grpc_code(exc: TensorwireError) -> grpc.StatusCode:
    if isinstance(exc, TransferTimeout):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, (ProtocolError, InvalidTensor, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL
