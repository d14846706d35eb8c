"""A model on a CUDA device in the parameter server and the gradient exchange: ``DeviceStaging``.

The servers keep CPU tensors, and a socket sends host memory, so every tensor of a device model
crosses the bus twice a step, through one pinned host buffer per server (``client/staging.py``
``HostArena``, kept and reused):

* push: the gradients (or a codec's payloads) go device -> pinned -> wire. ``send`` starts their
  copies on a side stream, piece by piece, and hands the transport ``StagedSegments``: it sends
  piece i while piece i+1 is copied. The copies start after what the training thread had queued
  when it called ``after_compute`` (its backward, a codec's encode).
* pull: the parameters go wire -> pinned -> device. The answer lands in the pinned buffer, then
  ``land`` starts the copies into the parameters, in place, on the side stream (with a pull codec,
  the payloads are copied and decoded there). The training thread calls ``order_compute``: its
  stream waits on an event for those copies; neither it nor the host waits for the device.

Codecs run on the device (``compression`` is device-agnostic): the error-feedback residuals stay
next to the gradients, and only payloads cross the bus, a tenth to a hundredth of the gradients'
bytes for int8 or top-k; a pull's payloads are decoded on the side stream into the parameters.

Where the bytes cannot go wrong: a buffer is handed out again only once the copies started on it
have completed (``HostArena.claim``); a piece is read by the transport only once its copy has
completed (``StagedSegments.ready``); the parameters are read by the training thread only after
its stream waited for the copies into them.

Lifecycle: the owner (a ``Worker`` or an ``ExchangeClient``) builds one per model, with the copier
for its device (``for_device``; tests pass a copier of their own that stands in for the device),
calls ``after_compute`` and ``order_compute`` from the training thread, and ``send``, ``receive``
and ``land`` from its event loop, with one ``key`` per connection (requests on one key take turns).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from tensorwire.client.staging import (
    PIECE_BYTES,
    Copier,
    CudaCopier,
    HostArena,
    StagedSegments,
    copy_in,
    stage_out,
)
from tensorwire.compression.codecs import Codec, decode_all
from tensorwire.errors import InvalidTensor


class DeviceStaging:
    """How the tensors of a model on a device travel to and from the servers (see the module doc)."""

    def __init__(self, copier: Copier, *, pin: bool | None = None, piece_bytes: int = PIECE_BYTES) -> None:
        if piece_bytes <= 0:
            raise ValueError("staging pieces must be positive")
        self.copier = copier
        self.pin = pin
        self.piece_bytes = piece_bytes
        self.arenas: dict[str, HostArena] = {}
        self._payloads: dict[str, torch.Tensor] = {}  # a pull codec's payloads, on the device
        self._landed: object = None  # the last landing the training thread has not waited for
        self._lock = threading.Lock()  # _landed: set on the event loop, taken by the training thread

    @staticmethod
    def for_device(device: torch.device) -> DeviceStaging | None:
        """Pinned staging for a CUDA device; None for the CPU (its tensors are sent as they are)."""
        if device.type == "cpu":
            return None
        if device.type != "cuda":
            raise InvalidTensor(f"a model on {device} cannot be trained here: CPU or CUDA only")
        return DeviceStaging(CudaCopier(device))

    # -- the training thread --------------------------------------------------------------------
    def after_compute(self) -> None:
        """Copies started from now on read what this thread has computed so far (its gradients),
        and write parameters it has finished with."""
        self.copier.after_compute()

    def order_compute(self) -> None:
        """This thread's stream waits for the landings so far (the host does not)."""
        with self._lock:
            landed, self._landed = self._landed, None
        if landed is not None:
            self.copier.compute_waits(landed)

    # -- the event loop -------------------------------------------------------------------------
    async def send(
        self, key: str, sources: Sequence[torch.Tensor], reserve: int = 0
    ) -> tuple[StagedSegments, torch.Tensor]:
        """The data of one request through ``key``'s arena: ``sources`` (device tensors, their
        bytes one after the other) copied piece by piece. Also the arena, at least ``reserve``
        bytes, for an answer that lands there once the request is sent (an allreduce)."""
        total = sum(s.numel() * s.element_size() for s in sources)
        arena = self._arena(key)
        host = await arena.claim(self.copier, max(total, reserve))
        staged = stage_out(self.copier, host[:total], sources, self.piece_bytes)
        arena.last = staged.last
        # The first piece waits for the training thread's work (its backward): awaited here, not
        # in the transport, whose connection would be held meanwhile.
        await staged.ready(1)
        return staged, host

    async def receive(self, key: str, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Host buffers of ``sizes`` bytes in ``key``'s arena, one after the other, for an answer
        to land in (once the copies started on the arena have completed)."""
        host = await self._arena(key).claim(self.copier, sum(sizes))
        return slices(host, sizes)

    def land(self, key: str, dests: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]) -> None:
        """Start the copies of a landed answer into the device tensors ``dests`` (in place)."""
        handle = copy_in(self.copier, list(zip(dests, hosts, strict=True)))
        self._landed_on(key, handle)

    async def land_decoded(
        self, key: str, codec: Codec, dests: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor]
    ) -> None:
        """A landed answer of ``codec`` payloads: copied to the device, decoded there into ``dests``."""
        pairs = list(zip(dests, hosts, strict=True))
        device = [self._payload(f"{key}/{i}", h.numel(), d.device) for i, (d, h) in enumerate(pairs)]
        handle = copy_in(self.copier, list(zip(device, hosts, strict=True)))
        if handle is not None:  # the payloads are checked as they are decoded: on the device, in order
            await self.copier.wait(handle)
        with self.copier.inside():
            decode_all(codec, device, dests)
        self._landed_on(key, self.copier.mark())

    def _landed_on(self, key: str, handle: object) -> None:
        self._arena(key).last = handle
        if handle is not None:
            with self._lock:
                self._landed = handle  # copies complete in order: the last one is enough

    def _arena(self, key: str) -> HostArena:
        arena = self.arenas.get(key)
        if arena is None:
            arena = self.arenas[key] = HostArena(self.pin)
        return arena

    def _payload(self, key: str, nbytes: int, device: torch.device) -> torch.Tensor:
        buffer = self._payloads.get(key)
        if buffer is None or buffer.numel() != nbytes or buffer.device != device:
            buffer = self._payloads[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buffer

    @property
    def pinned_bytes(self) -> int:
        """Host memory the arenas hold: about the model's bytes (each server's holds its shards)."""
        return sum(a.buffer.numel() for a in self.arenas.values())


def slices(host: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """``host`` cut into consecutive slices of ``sizes`` bytes."""
    out, at = [], 0
    for size in sizes:
        out.append(host[at : at + size])
        at += size
    return out


def device_of(tensors: Sequence[torch.Tensor], what: str) -> torch.device:
    """The one device all ``tensors`` are on (InvalidTensor naming ``what`` if there are several)."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        named = ", ".join(sorted(map(str, devices)))
        raise InvalidTensor(f"{what} are on several devices ({named}): one only")
    return next(iter(devices), torch.device("cpu"))
