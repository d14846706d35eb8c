"""A worker's tensors shard by shard: what a push sends, and where a pull lands.

``ModelShards`` does the tensor side of ``Worker``: it takes the gradients out of the module
(``take_grads``), encodes them in the push codec, through error feedback where that is on
(``encode``), lays out one server's push (``push_data``) and initial values (``values``), and
gives a pull the buffers it lands in (``pull_into``): the parameters themselves, in place, or
buffers a compressed pull is then decoded from into them. It sends nothing itself.

A model on a CUDA device goes through ``DeviceStaging`` (``ps/worker/device.py``): a push's bytes are
copied to a pinned host buffer piece by piece as they are sent, a pull lands there and is copied
into the parameters on a side stream; codecs and error feedback run on the device. A CPU model's
tensors are sent from, and land in, its own memory, as they are.

Also the checks a model passes before it takes part (``check_params``, ``check_trainable``) and
its digest (``model_digest``), which the servers compare with their job's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

import torch

from tensorwire.compression import Codec, ErrorFeedback
from tensorwire.compression.codecs import decode_all
from tensorwire.errors import InvalidTensor, ProtocolError
from tensorwire.ps.placement import Placement, Shard
from tensorwire.ps.worker.device import DeviceStaging, device_of
from tensorwire.transport.base import Sink
from tensorwire.types import TensorMeta
from tensorwire.wire.tensors import byte_view


class PullInto(NamedTuple):
    """Where one server's pull lands: ``sink`` for its answer, then ``finish`` once it is in."""

    sink: Sink
    nbytes: int  # the bytes the pull brings (a compressed pull: its payloads)
    # Once the answer is in: decodes a compressed pull into the parameters, starts the copies of a
    # staged one to the device; else nothing.
    finish: Callable[[], Awaitable[None]]


class ModelShards:
    """The parameters of a module, placed on the servers (see the module doc)."""

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        placement: Placement,
        push_codec: Codec | None,
        pull_codec: Codec | None,
        feedback: ErrorFeedback | None,
        *,
        staging: DeviceStaging | None = None,
    ) -> None:
        self.params = params
        self.placement = placement
        self.push_codec = push_codec
        self.pull_codec = pull_codec
        self.feedback = feedback
        self.device = device_of(list(params.values()), "the model's parameters")
        # A device model's tensors go through pinned staging (given, or the device's own).
        self.staging = staging if staging is not None else DeviceStaging.for_device(self.device)
        self._pull_buffers: dict[str, torch.Tensor] = {}  # a compressed pull lands here first

    def after_compute(self) -> None:
        """Staged copies read what the training thread computed so far (call it from there)."""
        if self.staging is not None:
            self.staging.after_compute()

    def order_compute(self) -> None:
        """The training thread's stream waits for the parameters pulled so far (call it from there)."""
        if self.staging is not None:
            self.staging.order_compute()

    def take_grads(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's gradient, taken from the module (None where backward made none: the
        server then leaves that parameter alone, as torch.optim does)."""
        grads: dict[str, torch.Tensor | None] = {}
        for name, param in self.params.items():
            grad = param.grad
            if grad is not None and (grad.is_sparse or grad.dtype != param.dtype):
                raise ProtocolError(f"the gradient of {name!r} must be dense {param.dtype}")
            grads[name] = None if grad is None else grad.contiguous()
            param.grad = None
        return grads

    def encode(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Each shard's gradient in ``push_codec`` (none without one), through error feedback
        when it is on; done in the caller's thread, before the push goes out."""
        codec = self.push_codec
        if codec is None:
            return {}
        payloads = {}
        for shard in self.placement.shards:
            grad = grads[shard.param]
            if grad is None:
                continue  # its residual waits for the next gradient
            view = self.view(grad, shard)
            payloads[shard.key] = (
                self.feedback.encode(shard.key, view) if self.feedback else codec.encode(view)
            )
        return payloads

    def push_parts(
        self,
        shards: Sequence[Shard],
        grads: dict[str, torch.Tensor | None],
        payloads: dict[str, torch.Tensor] | None = None,
    ) -> tuple[list[TensorMeta], list[torch.Tensor]]:
        """One server's push: a record per shard and the tensors whose bytes are its data. A
        parameter without a gradient travels as an empty record. With a codec the records still
        describe the gradients; the data is their payloads."""
        metas, data = [], []
        for shard in shards:
            grad = grads[shard.param]
            if grad is None:
                metas.append(TensorMeta(shard.key, self.params[shard.param].dtype, (0,), 0))
            else:
                metas.append(self.meta(shard))
                payload = payloads.get(shard.key) if payloads else None
                data.append(self.view(grad, shard) if payload is None else payload)
        return metas, data

    async def push_data(
        self,
        shards: Sequence[Shard],
        grads: dict[str, torch.Tensor | None],
        payloads: dict[str, torch.Tensor] | None,
        peer: str,
    ) -> tuple[list[TensorMeta], Sequence[memoryview]]:
        """``push_parts`` as it is sent to ``peer``: the tensors' own memory, or (a device model)
        their bytes staged through pinned memory as they are sent."""
        metas, tensors = self.push_parts(shards, grads, payloads)
        if self.staging is None:
            return metas, [byte_view(t) for t in tensors]
        staged, _ = await self.staging.send(peer, tensors)
        return metas, staged

    def values(self, shards: Sequence[Shard]) -> list[memoryview]:
        """The shards' current values, as the bytes that create a job (PS_INIT); a device model's
        are copied to the host (once per job)."""
        views = [self.view(self.params[s.param].data, s) for s in shards]
        if self.staging is not None:
            with self.staging.copier.inside():  # after the copies into the parameters so far
                views = [v.cpu() for v in views]
        return [byte_view(v) for v in views]

    async def pull_into(self, shards: Sequence[Shard], peer: str) -> PullInto:
        """Where a pull of ``shards`` from ``peer`` lands: straight into the parameters, or (with
        ``pull_codec``) into buffers kept per shard, decoded into the parameters by ``finish``;
        a device model's lands in pinned memory, copied into the parameters by ``finish``."""
        codec = self.pull_codec
        if self.staging is not None:
            return await self._staged_pull(shards, codec, peer, self.staging)
        if codec is not None:
            return self._encoded_pull(shards, codec, peer)
        expected = [m[:4] for m in map(self.meta, shards)]  # all but the version

        def land(metas: list[TensorMeta]) -> list[memoryview]:
            if [m[:4] for m in metas] != expected:
                raise ProtocolError(f"{peer} answered a pull with other shards than asked")
            return self.values(shards)

        return PullInto(land, sum(m[3] for m in expected), _nothing)

    def _encoded_pull(self, shards: Sequence[Shard], codec: Codec, peer: str) -> PullInto:
        payloads = [self._pull_buffer(s.key, codec.payload_bytes(s.numel)) for s in shards]
        land = self._payload_sink(shards, [p.numel() for p in payloads], peer, payloads)

        async def finish() -> None:
            params = [self.view(self.params[s.param].data, s) for s in shards]
            decode_all(codec, payloads, params)

        return PullInto(land, sum(p.numel() for p in payloads), finish)

    async def _staged_pull(
        self, shards: Sequence[Shard], codec: Codec | None, peer: str, staging: DeviceStaging
    ) -> PullInto:
        sizes = [self.meta(s).nbytes if codec is None else codec.payload_bytes(s.numel) for s in shards]
        hosts = await staging.receive(peer, sizes)
        params = [self.view(self.params[s.param].data, s) for s in shards]
        if codec is None:
            expected = [m[:4] for m in map(self.meta, shards)]

            def land(metas: list[TensorMeta]) -> list[memoryview]:
                if [m[:4] for m in metas] != expected:
                    raise ProtocolError(f"{peer} answered a pull with other shards than asked")
                return [byte_view(h) for h in hosts]

            async def finish() -> None:
                staging.land(peer, params, hosts)

            return PullInto(land, sum(sizes), finish)

        async def finish_decoded() -> None:
            await staging.land_decoded(peer, codec, params, hosts)

        return PullInto(self._payload_sink(shards, sizes, peer, hosts), sum(sizes), finish_decoded)

    @staticmethod
    def _payload_sink(
        shards: Sequence[Shard], sizes: Sequence[int], peer: str, buffers: Sequence[torch.Tensor]
    ) -> Sink:
        """A compressed pull's sink: records of the payloads, as uint8, landing in ``buffers``."""
        expected = [(s.key, torch.uint8, (n,)) for s, n in zip(shards, sizes, strict=True)]

        def land(metas: list[TensorMeta]) -> list[memoryview]:
            if [m[:3] for m in metas] != expected:
                raise ProtocolError(f"{peer} answered a pull with other shards than asked")
            return [byte_view(b) for b in buffers]

        return land

    def _pull_buffer(self, key: str, nbytes: int) -> torch.Tensor:
        buffer = self._pull_buffers.get(key)
        if buffer is None or buffer.numel() != nbytes:
            buffer = self._pull_buffers[key] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer

    def meta(self, shard: Shard) -> TensorMeta:
        dtype = self.params[shard.param].dtype
        return TensorMeta(shard.key, dtype, (shard.numel,), shard.numel * dtype.itemsize)

    @staticmethod
    def view(tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
        return tensor.view(-1)[shard.start : shard.stop]


def model_digest(params: dict[str, torch.nn.Parameter]) -> str:
    """``"<parameters>:<digest>"`` of the model's parameters' names, shapes and dtypes, in order:
    the servers refuse a worker whose model is not the job's (JobConfig.model)."""
    described = json.dumps([[name, list(p.shape), str(p.dtype)] for name, p in params.items()])
    return f"{len(params)}:{hashlib.sha256(described.encode()).hexdigest()[:32]}"


async def _nothing() -> None:
    return None


def check_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    params = dict(model.named_parameters())
    if not params:
        raise ValueError("the model has no parameters to train")
    for name, param in params.items():
        check_trainable(name, param)
    device_of(list(params.values()), "the model's parameters")
    return params


def check_trainable(name: str, tensor: torch.Tensor) -> None:
    """InvalidTensor unless ``tensor`` can be sent and landed in place: contiguous, float, on the
    CPU or a CUDA device (staged through pinned memory)."""
    if (
        tensor.device.type not in ("cpu", "cuda")
        or not tensor.is_contiguous()
        or not tensor.dtype.is_floating_point
    ):
        raise InvalidTensor(
            f"{name!r} must be a contiguous floating-point tensor on the CPU or a CUDA device"
        )
