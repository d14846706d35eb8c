"""The harness every case runs on: servers, clients and hand-written peers on one transport kind,
and the tensors the cases compare."""

from __future__ import annotations

import contextlib
import functools
import itertools
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tensorwire import AsyncClient, ClientOptions, Server, ServerOptions, TensorStore, transport
from tensorwire._aio import run
from tensorwire.security import TlsFiles, write_dev_certs
from tensorwire.server.options import ConnectionOptions
from tensorwire.transport.base import ByteStream
from tensorwire.types import Address, Limits
from tensorwire.wire.tensors import byte_view

SCHEMES = ("memory", "tcp", "tls", "grpc", "grpcs", "shm")
_names = itertools.count()
Case = Callable[["Harness"], Coroutine[Any, Any, None]]


@dataclass
class Harness:
    """Starts servers and peers on one transport kind, on the running loop."""

    scheme: str
    compression: str = "none"  # what every client of the harness asks for (ClientOptions.compression)

    def fresh_url(self) -> str:
        if self.scheme == "memory":
            return f"memory://conformance-{next(_names)}"
        return f"{self.scheme}://127.0.0.1:0"

    @contextlib.asynccontextmanager
    async def black_hole(self) -> AsyncIterator[str]:
        """A URL of this harness's scheme where a peer accepts connections and never answers."""

        async def swallow(stream: ByteStream) -> None:
            buf = memoryview(bytearray(65536))
            while await stream.recv_into(buf):
                pass

        stream_scheme = "memory" if self.scheme == "memory" else "tcp"  # gRPC and TLS run over TCP
        listener = await transport.listen(Address.parse(Harness(stream_scheme).fresh_url()), swallow)
        try:
            yield str(listener.address).replace(f"{stream_scheme}://", f"{self.scheme}://", 1)
        finally:
            await listener.close()

    @property
    def secure(self) -> bool:
        return self.scheme in ("tls", "grpcs", "rdmas")

    @contextlib.asynccontextmanager
    async def server(
        self,
        capacity: int = 1 << 30,
        limits: Limits | None = None,
        token: str | None = None,
        connections: ConnectionOptions | None = None,
    ) -> AsyncIterator[Server]:
        tls = TlsFiles(_certs()["server"], _certs()["server_key"]) if self.secure else None
        options = ServerOptions(limits=limits or Limits(), connections=connections or ConnectionOptions(),
                                tls=tls, token=token)  # fmt: skip
        server = Server(options, store=TensorStore(capacity))
        await server.start(self.fresh_url())
        try:
            yield server
        finally:
            await server.close()

    @contextlib.asynccontextmanager
    async def client(self, server: Server, **options: object) -> AsyncIterator[AsyncClient]:
        opts = {"timeout": 10.0, "connect_timeout": 5.0, "compression": self.compression, **options}
        if self.secure:
            opts["tls"] = TlsFiles(ca=_certs()["ca"])
        client = AsyncClient(str(server.addresses[0]), ClientOptions(**opts))  # type: ignore[arg-type]
        try:
            yield await client.connect()
        finally:
            await client.close()

    @contextlib.asynccontextmanager
    async def peer(self, handler: Callable[[ByteStream], Awaitable[None]]) -> AsyncIterator[str]:
        """A hand-written server: ``handler`` gets each raw stream. Yields its URL."""
        listener = await transport.listen(Address.parse(self.fresh_url()), handler)
        try:
            yield str(listener.address)
        finally:
            await listener.close()


@functools.cache
def _certs() -> dict[str, Path]:
    """Development certificates for the tls:// and grpcs:// runs, made once per process."""
    directory = Path(tempfile.mkdtemp(prefix="tensorwire-conformance-certs-"))
    return write_dev_certs(directory)


def run_case(case: Case, scheme: str, compression: str = "none") -> None:
    """Run one case against one transport on a fresh event loop (its clients asking for
    ``compression``)."""
    run(case(Harness(scheme, compression)))


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bytes of any dtype (bit patterns, not values: NaNs and all)."""
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(byte_view(a.contiguous())) == bytes(byte_view(b.contiguous()))
    )
