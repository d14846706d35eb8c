"""The client of the gradient exchange: a drop-in ``allreduce`` of gradients over one server.

::

    with ExchangeClient("tcp://ps-host:7070") as exchange:   # rank, world size from torchrun/env
        for x, y in loader:
            loss_fn(model(x), y).backward()
            exchange.average_gradients(model)   # every worker now holds the same mean gradients
            optimizer.step(); optimizer.zero_grad()

Each call sends this worker's tensors for one step (the client counts steps) in one request and
writes the mean over the live workers into the same tensors, in place. Leaving (``close``, or the
end of the ``with``) tells the server not to wait for this worker any more. Clients generated from
``train.GradientService`` (gRPC) take part in the same rounds (see ``tensorwire.ps.exchange_server``).

``ExchangeClient(url, codec="topk:0.01+fp16")`` sends the gradients compressed, with error
feedback (``error_feedback=False`` turns it off; it keeps one residual per tensor, the gradients'
size again); the means come back in full precision.

Tensors on a CUDA device are averaged in place too: their bytes go device -> pinned host memory
-> wire, piece by piece, the copy of each piece overlapping the send of the one before, and the
means come back through the same pinned buffer to the device on a side stream, which the caller's
stream waits for (``ps/device.py``); a codec encodes on the device, next to its residuals.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from types import TracebackType

import torch

from tensorwire import transport as transports
from tensorwire._aio import LoopThread
from tensorwire.compression import Codec, ErrorFeedback, resolve
from tensorwire.errors import ProtocolError
from tensorwire.ps.device import DeviceStaging, device_of, slices
from tensorwire.ps.rendezvous import env_int
from tensorwire.ps.rpc import PsChannel, Sender
from tensorwire.ps.shards import check_trainable
from tensorwire.security import Security, TlsFiles, client_token
from tensorwire.transport.base import FrameChannel
from tensorwire.types import Address, TensorMeta
from tensorwire.wire.tensors import byte_view

_MARGIN = 10.0


class ExchangeClient:
    """One worker's connection to a gradient exchange (see the module doc)."""

    def __init__(
        self,
        server: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        timeout: float = 120.0,
        connect_timeout: float = 10.0,
        token: str | None = None,
        tls: TlsFiles | None = None,
        codec: Codec | str | None = None,
        error_feedback: bool | None = None,
        staging: DeviceStaging | None = None,
    ) -> None:
        self.address = Address.parse(server)
        # For CUDA tensors: one per device, made on first use; or one given (tests stand a host
        # copier in for the device: every allreduce is then staged).
        self._staging = staging
        self._stagings: dict[torch.device, DeviceStaging | None] = {}
        self.codec = resolve(codec)
        if error_feedback is None:
            error_feedback = self.codec is not None and self.codec.lossy
        self.feedback = ErrorFeedback(self.codec) if error_feedback and self.codec is not None else None
        self.bytes_sent = 0
        self.rank = env_int("RANK", rank, 0)
        self.world_size = env_int("WORLD_SIZE", world_size, 1)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size}")
        self.timeout = timeout
        self.step = 0  # the step the next allreduce is for
        # This client's session: the exchange binds the rank to it (another client cannot send
        # under the rank meanwhile), as a parameter server binds a worker's rank to its incarnation.
        self.session = secrets.randbits(63) or 1
        self._options = transports.TransportOptions(
            connect_timeout, timeout + _MARGIN, security=Security(tls, client_token(token))
        )
        self._sender = Sender(self.rank, self.world_size, int(self.timeout * 1000))
        self._thread = LoopThread("tensorwire-exchange")
        self._conn: FrameChannel | None = None
        try:
            self._conn = self._thread.call(self._open(), connect_timeout + _MARGIN, f"connecting to {server}")
        except BaseException:
            self._thread.stop()
            raise

    def allreduce(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Replace each tensor by the mean of that tensor over the live workers, for this step;
        return how many workers the mean is over."""
        items = list(tensors.items())
        for name, tensor in items:
            check_trainable(name, tensor)
        staging = self._staging_for([t for _, t in items])
        payloads = [self._encode(name, tensor) for name, tensor in items] if self.codec else []
        step, self.step = self.step, self.step + 1
        wait = self.timeout + 2 * _MARGIN
        if staging is not None:
            staging.after_compute()  # the copies read the gradients once this thread's work made them
        coro = self._allreduce(items, payloads, step, staging)
        count: int = self._thread.call(coro, wait, f"the allreduce of step {step}")
        if staging is not None:
            staging.order_compute()  # this thread's stream waits for the means (the host does not)
        return count

    def _staging_for(self, tensors: list[torch.Tensor]) -> DeviceStaging | None:
        device = device_of(tensors, "the tensors of one allreduce")
        if self._staging is not None:
            return self._staging
        if device not in self._stagings:
            self._stagings[device] = DeviceStaging.for_device(device)
        return self._stagings[device]

    def average_gradients(self, model: torch.nn.Module) -> int:
        """``allreduce`` of the ``.grad`` of every parameter of ``model`` (zeros where it has none)."""
        grads = {}
        for name, param in model.named_parameters():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads[name] = param.grad
        return self.allreduce(grads)

    def close(self) -> None:
        """Leave: the other workers' rounds stop waiting for this one."""
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        try:
            wait = self._options.connect_timeout + _MARGIN
            self._thread.call(self._leave(conn), wait, "leaving the exchange")
        finally:
            self._thread.stop()

    def __enter__(self) -> ExchangeClient:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def _open(self) -> FrameChannel:
        return await transports.open_channel(self.address, self._options, what="the gradient exchange")

    def _encode(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        assert self.codec is not None
        if self.feedback is not None:  # the tensor is overwritten with what was sent: the mean replaces it
            return self.feedback.encode(name, tensor.view(-1))
        return self.codec.encode(tensor)

    async def _allreduce(
        self,
        items: list[tuple[str, torch.Tensor]],
        payloads: list[torch.Tensor],
        step: int,
        staging: DeviceStaging | None = None,
    ) -> int:
        if self._conn is None:
            raise ProtocolError("the exchange client is closed")
        metas = [TensorMeta(n, t.dtype, tuple(t.shape), t.numel() * t.element_size()) for n, t in items]
        sent = [(m.name, m.dtype, m.shape) for m in metas]
        sources = payloads if self.codec else [t for _, t in items]
        key = str(self.address)
        if staging is None:
            data: Sequence[memoryview] = [byte_view(t) for t in sources]
            landing = [byte_view(t) for _, t in items]  # the means land in the caller's tensors
        else:  # the means land where the request was staged: it is all sent before they come
            data, host = await staging.send(key, sources, reserve=sum(m.nbytes for m in metas))
            hosts = slices(host, [m.nbytes for m in metas])
            landing = [byte_view(h) for h in hosts]

        def land(answer: list[TensorMeta]) -> list[memoryview]:
            if [(m.name, m.dtype, m.shape) for m in answer] != sent:
                raise ProtocolError("the exchange answered with other tensors than were sent")
            return landing

        self.bytes_sent += sum(len(d) for d in data)
        what = f"the mean of step {step} from {self.address}"
        codec = self.codec.name if self.codec else None
        rpc = PsChannel(self._conn, self._sender)
        count = await rpc.allreduce(step, self.session, metas, data, land, codec=codec, what=what)
        if staging is not None:
            staging.land(key, [t for _, t in items], hosts)
        return count

    async def _leave(self, conn: FrameChannel) -> None:
        try:
            await PsChannel(conn, self._sender).leave(self.step, self.session, what="leaving the exchange")
        finally:
            await conn.close()
