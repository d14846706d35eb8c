"""The client side of ``rdma://``: the frame protocol for control, the transfer engine for bytes.

``RdmaTransport`` is a ``FramedTransport`` (a ``FrameChannel``; not ``Ranged``: its large bytes
move through the engine, not frames) on a TCP connection that, after HELLO (the token), attaches
(RDMA_ATTACH: the server names its engine's session and protocol, which must be this client's)
and then moves tensors like this (docs/protocol.md §17):

* ``put``: RDMA_PUT reserves the tensors on the server, which answers with the engine addresses of
  the buffers it registered for them; the client writes each tensor one-sided from its own memory
  into its buffer, then RDMA_END commits with the checksum of every chunk (the server checks them
  against what landed before anything is visible). Tensors up to the server's inline limit travel
  in RDMA_END's data section instead, checksummed like any frame.
* ``get``: RDMA_GET answers with the addresses of copies the server registered for this request
  and their chunk checksums; the client reads each one-sided straight into the caller's buffer
  (``out``), checks every chunk (``CorruptFrame`` if one differs: a retry reads again), and
  releases the copies (RDMA_END, sent in the background).

The caller's buffers are registered with this process's engine for the transfer that moves them
(``Registrations``, the engine's ``cache``; none in TCP mode, where the engine does not need it),
and stay alive until the engine's thread is done with them, even when the call gave up first.
Every connection from this process shares one engine (``client_engine``) until a server's engine
turns out to be a different one under a name that engine reached before: the engine names a peer
only ``host:port`` and keeps what it learned of it by that name, so a restarted server whose
engine drew a freed port gets a fresh client engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator, Sequence

import torch

from tensorwire.errors import (
    ConnectionLost,
    CorruptFrame,
    InvalidTensor,
    ProtocolError,
    RdmaUnavailable,
    TensorwireError,
)
from tensorwire.transport import tcp
from tensorwire.transport.base import Listener, Progress, PutBatch, Sink, StreamHandler
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.transport.rdma_engine import (
    HOST_ENV,
    Engine,
    client_engine,
    release_client_engine,
    requested_protocol,
)
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import rdma as wr
from tensorwire.wire.frame import Opcode
from tensorwire.wire.tensors import byte_view, check_out


def local_host(server: Address) -> str:
    """The local address this host reaches ``server`` from (``TENSORWIRE_RDMA_HOST`` overrides):
    where the server's engine will see this client's engine."""
    override = os.environ.get(HOST_ENV)
    if override:
        return override
    family = socket.AF_INET6 if ":" in server.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no packet leaves: it only routes
        try:
            probe.connect((server.host, server.port or 9))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class RdmaTransport(FramedTransport):
    """A client's connection to a server that serves ``rdma://`` (see the module docstring)."""

    engine: Engine
    peer: wr.Attach

    async def attach(self) -> None:
        """Learn the server's engine, then get this process's engine that may reach it (made on
        first use, shared by every connection from here); RdmaUnavailable if the engine cannot be
        had here or the server serves no RDMA."""
        self._releases: list[int] = []
        self._flushing: asyncio.Task[None] | None = None
        request = wr.encode_attach_request(requested_protocol())
        try:
            reader = await self.call(Opcode.RDMA_ATTACH, request, what="RDMA_ATTACH")
        except ProtocolError as exc:
            raise RdmaUnavailable(f"{self.address} does not serve RDMA: {exc}") from exc
        self.peer = wr.decode_attach_answer(reader)
        here, peer = local_host(self.address), self.peer
        self.engine = await asyncio.get_running_loop().run_in_executor(
            None, client_engine, here, peer.session, peer.instance, peer.protocol
        )
        self.cache = self.engine.cache

    # -- put ---------------------------------------------------------------------------------------
    async def put(self, batch: PutBatch, progress: Progress | None = None) -> int:
        metas: list[TensorMeta] = []
        views: list[memoryview] = []
        for i in range(batch.parts):
            part_metas, part_views = batch.part(i)
            metas += part_metas
            views += part_views
        what = f"buffers for a put of {len(metas)} tensors"
        reader = await self.call(Opcode.RDMA_PUT, wm.encode_records(metas), what=what)
        reservation = reader.u64()
        refs = wr.decode_refs(reader, len(metas))
        reader.done()
        try:
            sums = [await self._write(ref, metas[ref.item], views[ref.item], progress) for ref in refs]
        except BaseException:
            self._release_soon(reservation)
            raise
        large = {ref.item for ref in refs}
        inline = [i for i in range(len(metas)) if i not in large]
        body = wr.encode_end(reservation, wr.End.COMMIT, self._chunk_size, sums, [metas[i] for i in inline])
        data = [views[i] for i in inline]
        reader = await self.call(Opcode.RDMA_END, body, data, what=f"commit of {what}", progress=progress)
        version = reader.u64()
        reader.done()
        return version

    async def _write(
        self, ref: wr.BufferRef, meta: TensorMeta, view: memoryview, progress: Progress | None
    ) -> tuple[int, ...]:
        """One tensor into the server's buffer; the checksums of its chunks (computed meanwhile)."""
        if ref.meta[:4] != meta[:4] or view.nbytes != meta.nbytes:
            raise ProtocolError(f"{self.address} handed out a buffer for another tensor")
        loop = asyncio.get_running_loop()
        sums = loop.run_in_executor(None, wr.chunk_checksums, self._checksum, view, self._chunk_size)
        with self.cache.using(view) as local:
            await self.engine.write(
                self.peer.session, local, ref.address, view.nbytes, timeout=self.timeout, keep=view
            )
        if progress is not None:
            progress(view.nbytes)
        return await sums

    # -- get ---------------------------------------------------------------------------------------
    async def get(
        self, names: Sequence[str], sink: Sink, progress: Progress | None = None
    ) -> list[TensorMeta]:
        inline_metas: list[TensorMeta] = []
        landed: list[memoryview] = []

        def land(records: list[TensorMeta]) -> list[memoryview]:
            inline_metas.extend(records)
            landed.extend(memoryview(bytearray(m.nbytes)) for m in records)  # small tensors only
            return landed

        body = wr.encode_get_request(self._chunk_size, names)
        what = f"the buffers of {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        reader = await self.call(Opcode.RDMA_GET, body, sink=land, what=what)
        reservation = reader.u64()
        refs = wr.decode_refs(reader, len(names), self._chunk_size)
        reader.done()
        try:
            metas = self._order(names, inline_metas, refs)
            buffers = sink(metas)
            for ref in refs:
                await self._read(ref, buffers[ref.item], progress)
        finally:
            if reservation:
                self._release_soon(reservation)
        slots = [i for i in range(len(names)) if i not in {ref.item for ref in refs}]
        for slot, data in zip(slots, landed, strict=True):
            buffers[slot][:] = data
        if progress is not None and landed:
            progress(sum(d.nbytes for d in landed))
        return metas

    def _order(
        self, names: Sequence[str], inline: Sequence[TensorMeta], refs: Sequence[wr.BufferRef]
    ) -> list[TensorMeta]:
        """Every tensor's record in request order; ProtocolError if the answer is for others."""
        metas: list[TensorMeta | None] = [None] * len(names)
        for ref in refs:
            metas[ref.item] = ref.meta
        slots = [i for i, m in enumerate(metas) if m is None]
        if len(slots) != len(inline):
            raise ProtocolError(f"{self.address} answered for other tensors than the ones asked for")
        for slot, meta in zip(slots, inline, strict=True):
            metas[slot] = meta
        ordered = [m for m in metas if m is not None]
        if [m.name for m in ordered] != list(names):
            raise ProtocolError(f"{self.address} answered for other tensors than the ones asked for")
        return ordered

    async def _read(self, ref: wr.BufferRef, dest: memoryview, progress: Progress | None) -> None:
        """One tensor from the server's buffer into ``dest``, every chunk checked."""
        if dest.nbytes != ref.meta.nbytes:
            raise ProtocolError(
                f"the buffer for {ref.meta.name!r} holds {dest.nbytes}, not {ref.meta.nbytes}"
            )
        with self.cache.using(dest, landing=True) as local:  # unregistered before its bytes are checked
            await self.engine.read(
                self.peer.session, local, ref.address, dest.nbytes, timeout=self.timeout, keep=dest
            )
        loop = asyncio.get_running_loop()
        bad = await loop.run_in_executor(
            None, wr.bad_chunk, self._checksum, dest, self._chunk_size, ref.checksums
        )
        if bad is not None:
            raise CorruptFrame(f"chunk {bad} of {ref.meta.name!r} read through the engine fails its checksum")
        if progress is not None:
            progress(dest.nbytes)

    # -- CUDA tensors: GPU-direct (DeviceDirect) ----------------------------------------------------
    @property
    def gpu_direct(self) -> bool:
        """Whether this process's engine registers device memory (its CUDA build)."""
        return self.engine.gpu_direct

    async def put_device(self, name: str, tensor: torch.Tensor) -> int:
        """A CUDA tensor written by the engine straight from device memory; the chunk checksums
        come from a host copy made meanwhile (they still cover every chunk)."""
        tensor = tensor.detach().contiguous()
        meta = TensorMeta(name, tensor.dtype, tuple(tensor.shape), tensor.numel() * tensor.element_size())
        reader = await self.call(Opcode.RDMA_PUT, wm.encode_records([meta]), what=f"a buffer for {name!r}")
        reservation = reader.u64()
        refs = wr.decode_refs(reader, 1)
        reader.done()
        loop = asyncio.get_running_loop()
        host = await loop.run_in_executor(None, lambda: byte_view(tensor.cpu()))
        try:
            sums = []
            for ref in refs:
                if ref.meta[:4] != meta[:4]:
                    raise ProtocolError(f"{self.address} handed out a buffer for another tensor")
                with _device_registered(self.engine, tensor) as local:
                    await self.engine.write(
                        self.peer.session, local, ref.address, meta.nbytes, timeout=self.timeout, keep=tensor
                    )
                sums.append(wr.chunk_checksums(self._checksum, host, self._chunk_size))
        except BaseException:
            self._release_soon(reservation)
            raise
        inline = [] if refs else [meta]
        body = wr.encode_end(reservation, wr.End.COMMIT, self._chunk_size, sums, inline)
        reader = await self.call(Opcode.RDMA_END, body, [host] if inline else [], what=f"commit of {name!r}")
        return int(_finish_u64(reader))

    async def get_device(self, name: str, out: torch.Tensor) -> int:
        """``name`` read by the engine straight into ``out``'s device memory, every chunk checked on
        a host copy; the version read."""
        if not out.is_contiguous():
            raise InvalidTensor("a GPU-direct get needs a contiguous out tensor")
        inline_metas: list[TensorMeta] = []
        landed: list[memoryview] = []

        def land(records: list[TensorMeta]) -> list[memoryview]:
            inline_metas.extend(records)
            landed.extend(memoryview(bytearray(m.nbytes)) for m in records)
            return landed

        body = wr.encode_get_request(self._chunk_size, [name])
        reader = await self.call(Opcode.RDMA_GET, body, sink=land, what=f"the buffer of {name!r}")
        reservation = reader.u64()
        refs = wr.decode_refs(reader, 1, self._chunk_size)
        reader.done()
        try:
            meta = self._order([name], inline_metas, refs)[0]
            check_out(meta, out, device_ok=True)
            if not refs:
                out.copy_(torch.frombuffer(landed[0], dtype=torch.uint8).view(meta.dtype).reshape(meta.shape))
                return meta.version
            with _device_registered(self.engine, out) as local:
                await self.engine.read(
                    self.peer.session, local, refs[0].address, meta.nbytes, timeout=self.timeout, keep=out
                )
            host = byte_view(out.cpu())
            if wr.bad_chunk(self._checksum, host, self._chunk_size, refs[0].checksums) is not None:
                raise CorruptFrame(f"{name!r} read into device memory fails its checksums")
            return meta.version
        finally:
            if reservation:
                self._release_soon(reservation)

    # -- releases ----------------------------------------------------------------------------------
    def _release_soon(self, reservation: int) -> None:
        """Free a reservation on the server in the background (a lost connection frees them all)."""
        if self.closed:
            return
        self._releases.append(reservation)
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        while self._releases and not self.closed:
            reservation = self._releases.pop(0)
            with contextlib.suppress(TensorwireError):
                body = wr.encode_end(reservation, wr.End.RELEASE)
                await self.call(Opcode.RDMA_END, body, what="RDMA_END (release)")

    async def close(self) -> None:
        await super().close()
        flushing = getattr(self, "_flushing", None)
        if flushing is not None:
            flushing.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionLost):
                await flushing
        engine = self.__dict__.pop("engine", None)  # once, however often close is called
        if engine is not None:
            release_client_engine(engine)


@contextlib.contextmanager
def _device_registered(engine: Engine, tensor: torch.Tensor) -> Iterator[int]:
    """``tensor``'s device memory registered with the engine for one transfer (a CUDA build
    registers ``cuda:N`` locations directly; the NIC then reads and writes the GPU's memory)."""
    address, length = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    engine.register(address, length, location=f"cuda:{tensor.device.index or 0}")
    try:
        yield address
    finally:
        engine.unregister(address)


def _finish_u64(reader: wm.MetaReader) -> int:
    value = reader.u64()
    reader.done()
    return value


async def listen_stream(address: Address, handler: StreamHandler) -> Listener:
    """The control connections of ``rdma://HOST:PORT``: TCP."""
    return await tcp.listen(address, handler, scheme="rdma")


__all__ = ["RdmaTransport", "listen_stream"]
