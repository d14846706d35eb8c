"""The client side of ``rdma://``: the frame protocol for control, the transfer engine for bytes.

``RdmaTransport`` is a ``SegmentTransport`` (segments.py: a ``FramedTransport``, so a
``FrameChannel``; not ``Ranged``: its large bytes move through the engine, not frames) on a TCP
connection that, after HELLO (the token), attaches (RDMA_ATTACH: the server names its engine's
session and protocol, which must be this client's) and then moves tensors like this
(docs/protocol.md §17):

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
Every connection from this process shares one engine (``client_engine``: rdma_clients.py) until a
server's engine turns out to be a different one under a name that engine reached before: the
engine names a peer only ``host:port`` and keeps what it learned of it by that name, so a
restarted server whose engine drew a freed port gets a fresh client engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
from collections.abc import Iterator, Sequence

import torch

from tensorwire.errors import (
    CorruptFrame,
    InvalidTensor,
    ProtocolError,
    RdmaUnavailable,
)
from tensorwire.transport.base import Listener, Progress, Sink, StreamHandler
from tensorwire.transport.rdma_clients import client_engine, release_client_engine
from tensorwire.transport.rdma_engine import HOST_ENV, Engine, requested_protocol
from tensorwire.transport.segments import SegmentTransport, Sums, in_order, inline_sink, land_inline
from tensorwire.transport.tcp_listener import listen as listen_tcp
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


class RdmaTransport(SegmentTransport[wr.BufferRef]):
    """A client's connection to a server that serves ``rdma://`` (see the module docstring; its puts
    go the four steps of segments.py)."""

    RESERVE = Opcode.RDMA_PUT
    COMMIT = Opcode.RDMA_END
    ROOM = "buffer"

    engine: Engine
    peer: wr.Attach

    async def attach(self) -> None:
        """Learn the server's engine, then get this process's engine that may reach it (made on
        first use, shared by every connection from here); RdmaUnavailable if the engine cannot be
        had here or the server serves no RDMA."""
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

    # -- put (SegmentTransport.put) -----------------------------------------------------------------
    def _decode_refs(self, reader: wm.MetaReader, count: int) -> list[wr.BufferRef]:
        return wr.decode_refs(reader, count)

    async def _fill(
        self, refs: Sequence[wr.BufferRef], metas: Sequence[TensorMeta], views: Sequence[memoryview],
        progress: Progress | None,
    ) -> Sums:  # fmt: skip
        return [await self._write(ref, metas[ref.item], views[ref.item], progress) for ref in refs]

    def _commit_body(self, reservation: int, sums: Sums, inline: Sequence[TensorMeta]) -> bytes:
        return wr.encode_end(reservation, wr.End.COMMIT, self._chunk_size, sums, inline)

    def _release_frames(self, releases: Sequence[int], aborts: Sequence[int]) -> list[tuple[int, bytes, str]]:
        """One RDMA_END each: a put abandoned before its commit is released as a get's copies are."""
        body = functools.partial(wr.encode_end, action=wr.End.RELEASE)
        return [(Opcode.RDMA_END, body(r), "RDMA_END (release)") for r in [*releases, *aborts]]

    async def _write(
        self, ref: wr.BufferRef, meta: TensorMeta, view: memoryview, progress: Progress | None
    ) -> tuple[int, ...]:
        """One tensor into the server's buffer; the checksums of its chunks (computed meanwhile)."""
        self._check_ref(ref, meta)
        if view.nbytes != meta.nbytes:
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
        inline_metas, landed, land = inline_sink()
        body = wr.encode_get_request(self._chunk_size, names)
        what = f"the buffers of {names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
        reader = await self.call(Opcode.RDMA_GET, body, sink=land, what=what)
        reservation = reader.u64()
        refs = wr.decode_refs(reader, len(names), self._chunk_size)
        reader.done()
        try:
            metas, slots = self._order(names, inline_metas, refs)
            buffers = sink(metas)
            for ref in refs:
                await self._read(ref, buffers[ref.item], progress)
        finally:
            if reservation:
                self._later([reservation])
        land_inline(buffers, slots, landed, progress)
        return metas

    def _order(
        self, names: Sequence[str], inline: Sequence[TensorMeta], refs: Sequence[wr.BufferRef]
    ) -> tuple[list[TensorMeta], list[int]]:
        """Every tensor's record in request order, and the items that came inline; ProtocolError
        if the answer is for others."""
        ordered, slots = in_order(self.address, len(names), inline, refs)
        if [m.name for m in ordered] != list(names):
            raise ProtocolError(f"{self.address} answered for other tensors than the ones asked for")
        return ordered, slots

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
        reservation, refs = await self._reserve([meta], f"a buffer for {name!r}")
        loop = asyncio.get_running_loop()
        host = await loop.run_in_executor(None, lambda: byte_view(tensor.cpu()))
        try:
            sums = []
            for ref in refs:
                self._check_ref(ref, meta)
                with _device_registered(self.engine, tensor) as local:
                    await self.engine.write(
                        self.peer.session, local, ref.address, meta.nbytes, timeout=self.timeout, keep=tensor
                    )
                sums.append(wr.chunk_checksums(self._checksum, host, self._chunk_size))
        except BaseException:
            self._later(aborts=[reservation])
            raise
        inline = [] if refs else [meta]
        return await self._commit(
            reservation, sums, inline, [host] if inline else [], what=f"commit of {name!r}"
        )

    async def get_device(self, name: str, out: torch.Tensor) -> int:
        """``name`` read by the engine straight into ``out``'s device memory, every chunk checked on
        a host copy; the version read."""
        if not out.is_contiguous():
            raise InvalidTensor("a GPU-direct get needs a contiguous out tensor")
        inline_metas, landed, land = inline_sink()
        body = wr.encode_get_request(self._chunk_size, [name])
        reader = await self.call(Opcode.RDMA_GET, body, sink=land, what=f"the buffer of {name!r}")
        reservation = reader.u64()
        refs = wr.decode_refs(reader, 1, self._chunk_size)
        reader.done()
        try:
            meta = self._order([name], inline_metas, refs)[0][0]
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
                self._later([reservation])

    async def close(self) -> None:
        try:
            await super().close()
        finally:  # a connection that closed badly still lets its engine go
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


async def listen_stream(address: Address, handler: StreamHandler) -> Listener:
    """The control connections of ``rdma://HOST:PORT``: TCP."""
    return await listen_tcp(address, handler, scheme="rdma")


__all__ = ["RdmaTransport", "listen_stream"]
