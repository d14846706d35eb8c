"""An unauthenticated connection holds its slot for ``auth_timeout`` at most (issue 13, item 11).

Before, a socket that never authenticated kept one of ``--max-connections`` slots until the 900 s
idle timeout, and TLS handshakes in progress were not counted at all. Now a connection's TLS
handshake and first frame (a HELLO with the token, where one is required) must be in within
``Server(auth_timeout=...)`` (``--auth-timeout``), pending handshakes count as connections, and
the gRPC listener drops a connection that has not finished its handshake in the same time. On a
server without a token, the first frame must still arrive in time: a silent socket is no client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import torch

from tensorwire.client import AsyncClient, ClientOptions
from tensorwire.security import Security, TlsFiles, write_dev_certs
from tensorwire.server import Server
from tensorwire.server.options import ConnectionOptions, ServerOptions
from tensorwire.store import TensorStore
from tensorwire.types import Address

TOKEN = "deadline-token"


@asynccontextmanager
async def serving(
    url: str, security: Security | None = None, auth_timeout: float = 5.0, max_connections: int = 1024
) -> AsyncIterator[Server]:
    tls, token = (security.tls, security.token) if security is not None else (None, None)
    limits = ConnectionOptions(auth_timeout=auth_timeout, max_connections=max_connections)
    options = ServerOptions(tls=tls, token=token, connections=limits)
    server = Server(options, store=TensorStore(1 << 24))
    await server.start(url)
    try:
        yield server
    finally:
        await server.close()


async def silent_socket(address: Address) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection that never says a word (no TLS ClientHello, no frame)."""
    return await asyncio.open_connection(address.host, address.port)


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    """How long until the server closed the connection (whatever it sent first, such as gRPC's
    HTTP/2 settings); fails if it is still open after ``seconds``."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(4096):
                pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"an unauthenticated connection was still open after {seconds}s") from None
    return time.monotonic() - start


async def until(condition: object, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"waited {seconds}s for {what}"
        await asyncio.sleep(0.01)


def test_a_silent_connection_to_a_token_server_is_closed_at_the_deadline() -> None:
    async def main() -> None:
        security = Security(token=TOKEN)
        async with serving("tcp://127.0.0.1:0", security=security, auth_timeout=0.3) as srv:
            reader, writer = await silent_socket(srv.addresses[0])
            await closed_within(reader, 5.0)
            writer.close()
            await until(lambda: srv.counts.connections == 0, 5.0, "the slot to be free")
            assert srv.counts.refused.get("auth_timeout") == 1

    asyncio.run(main())


def test_without_a_token_the_first_frame_must_come_in_time() -> None:
    async def main() -> None:
        async with serving("tcp://127.0.0.1:0", auth_timeout=0.3) as srv:
            client = AsyncClient(str(srv.addresses[0]))
            await client.ping()  # a client speaks first: admitted, and kept past the deadline
            reader, writer = await silent_socket(srv.addresses[0])
            await until(lambda: srv.counts.connections == 2, 5.0, "both connections")
            await closed_within(reader, 5.0)
            writer.close()
            assert srv.counts.connections == 1, "the client that spoke was closed too"
            await client.ping()
            await client.close()

    asyncio.run(main())


def test_pending_tls_handshakes_count_and_end_at_the_deadline(tmp_path: Path) -> None:
    certs = write_dev_certs(tmp_path)
    security = Security(TlsFiles(certs["server"], certs["server_key"]), TOKEN)

    async def main() -> None:
        async with serving(
            "tls://127.0.0.1:0", security=security, max_connections=3, auth_timeout=1.0
        ) as srv:
            silent = [await silent_socket(srv.addresses[0]) for _ in range(3)]
            # Handshakes that have not even started hold slots, so they are counted...
            await until(lambda: srv.counts.connections == 3, 5.0, "three pending handshakes to count")
            # ...and give them back at the deadline, so an authorised client gets in.
            for reader, writer in silent:
                await closed_within(reader, 5.0)
                writer.close()
            options = ClientOptions(tls=TlsFiles(ca=certs["ca"]), token=TOKEN, timeout=10, connect_timeout=5)
            client = AsyncClient(str(srv.addresses[0]), options)
            await client.put("t/x", torch.arange(4))
            assert torch.equal(await client.get("t/x"), torch.arange(4))
            await client.close()

    asyncio.run(main())


def test_grpc_drops_a_connection_that_never_finishes_its_handshake() -> None:
    async def main() -> None:
        security = Security(token=TOKEN)
        async with serving("grpc://127.0.0.1:0", security=security, auth_timeout=0.5) as srv:
            reader, writer = await silent_socket(srv.addresses[0])
            await closed_within(reader, 5.0)  # grpcio's own default is 120 s
            writer.close()

    asyncio.run(main())
