"""rdma://: the engine's data port is no way around authentication. The server registers memory
only for an authenticated request on an rdma:// connection, only for that request's lifetime, and
within per-connection bounds; one connection cannot end another's reservation; stored bytes are
never what the engine serves. Each test fails without the check it names."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tensorwire import Server, TensorStore
from tensorwire._aio import run
from tensorwire.client.batches import TensorBatch
from tensorwire.errors import AuthenticationError, ErrorCode, LimitExceeded, ProtocolError, TensorwireError
from tensorwire.security import Security
from tensorwire.server.options import ServerOptions
from tensorwire.server.rdma import MAX_OPEN, RdmaService
from tensorwire.testing import rdma as kit
from tensorwire.testing.conformance import raw, read_reply
from tensorwire.transport import FrameChannel, TransportOptions, open_channel
from tensorwire.transport.rdma import RdmaTransport
from tensorwire.transport.rdma_engine import address_of
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import rdma as wr
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import Header, Opcode, encode_frame_head

pytestmark = pytest.mark.skipif(
    kit.unavailable() is not None, reason=f"rdma:// cannot run: {kit.unavailable()}"
)
TOKEN = "s3cret-token"
BIG = 1 << 20  # over the inline limit: moves through the engine


@pytest.fixture(autouse=True)
def tcp_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in kit.TCP_MODE.items():
        monkeypatch.setenv(key, value)


def _service(server: Server) -> RdmaService:
    return next(e for e in server.extensions if isinstance(e, RdmaService))


def _registered(server: Server) -> int:
    return len(_service(server).engine.registered)


async def _server(token: str | None = None) -> Server:
    server = Server(ServerOptions(token=token), store=TensorStore(1 << 30))
    await server.start("rdma://127.0.0.1:0")
    return server


async def _channel(server: Server, token: str | None = TOKEN) -> FrameChannel:
    options = TransportOptions(5.0, 5.0, security=Security(token=token))
    return await open_channel(server.addresses[0], options, what="the test")


def _meta(name: str, nbytes: int = BIG) -> TensorMeta:
    return TensorMeta(name, torch.uint8, (nbytes,), nbytes)


async def _reserve(channel: FrameChannel, name: str, nbytes: int = BIG) -> tuple[int, list[wr.BufferRef]]:
    reader = await channel.call(Opcode.RDMA_PUT, wm.encode_records([_meta(name, nbytes)]), what="RDMA_PUT")
    reservation = reader.u64()
    refs = wr.decode_refs(reader, 1)
    reader.done()
    return reservation, refs


def test_an_unauthenticated_connection_gets_no_buffer_address() -> None:
    """Without HELLO and the token, RDMA_ATTACH and RDMA_PUT are refused before any handler runs:
    nothing is registered (the session's authentication check)."""

    async def case() -> None:
        server = await _server(TOKEN)
        try:
            for op, body in [
                (Opcode.RDMA_ATTACH, wr.encode_attach_request("tcp")),
                (Opcode.RDMA_PUT, wm.encode_records([_meta("x")])),
            ]:
                async with raw(server) as (stream, reader):
                    header = Header(1, op, 0, ChecksumKind.XXH3_64, 7, len(body), 0, 0)
                    await stream.send([encode_frame_head(header, body)])
                    answer, reply = await read_reply(reader)
                    assert answer.is_error
                    code, _ = wm.decode_error(reply)
                    assert code == ErrorCode.UNAUTHENTICATED
            assert _registered(server) == 0
            with pytest.raises(AuthenticationError):
                await _channel(server, token="wrong")
            assert _registered(server) == 0
        finally:
            await server.close()

    run(case())


def test_a_reservation_lives_only_as_long_as_its_request() -> None:
    """Registered while the put is open, unregistered once RDMA_END releases it: an engine peer
    holding the address can no longer reach it."""

    async def case() -> None:
        server = await _server()
        try:
            channel = await _channel(server, None)
            reservation, refs = await _reserve(channel, "x")
            assert _registered(server) == 1 and refs[0].address in _service(server).engine.registered
            await channel.call(Opcode.RDMA_END, wr.encode_end(reservation, wr.End.RELEASE), what="release")
            assert _registered(server) == 0
            assert server.store.reserved == 0
            assert isinstance(channel, RdmaTransport)
            src = torch.zeros(BIG, dtype=torch.uint8)
            with (
                pytest.raises(TensorwireError, match="failed"),
                channel.cache.using(memoryview(src.numpy()).cast("B")) as local,
            ):
                await channel.engine.write(channel.peer.session, local, refs[0].address, BIG, timeout=10.0)
            await channel.close()
        finally:
            await server.close()

    run(case())


def test_a_commit_for_another_connections_reservation_is_refused() -> None:
    async def case() -> None:
        server = await _server()
        try:
            owner, intruder = await _channel(server, None), await _channel(server, None)
            reservation, _ = await _reserve(owner, "victim")
            sums = [wr.chunk_checksums(1, memoryview(bytes(BIG)), 1 << 20)]
            body = wr.encode_end(reservation, wr.End.COMMIT, 1 << 20, sums)
            with pytest.raises(ProtocolError, match="does not hold"):
                await intruder.call(Opcode.RDMA_END, body, what="a stolen commit")
            with pytest.raises(ProtocolError, match="does not hold"):
                await intruder.call(Opcode.RDMA_END, wr.encode_end(reservation, wr.End.RELEASE), what="x")
            assert len(server.store) == 0
            assert _registered(server) == 1  # still the owner's
            await owner.close()
            await intruder.close()
        finally:
            await server.close()

    run(case())


def test_open_requests_and_registered_bytes_are_bounded_per_connection() -> None:
    async def case() -> None:
        server = await _server()
        try:
            channel = await _channel(server, None)
            for i in range(MAX_OPEN):
                await _reserve(channel, f"t{i}", 70_000)
            with pytest.raises(LimitExceeded, match="open on this connection"):
                await _reserve(channel, "one-too-many", 70_000)
            assert _registered(server) == MAX_OPEN
            await channel.close()
            await _until(lambda: _registered(server) == 0 and server.store.reserved == 0)
            _service(server).max_registered = 3 * BIG
            channel = await _channel(server, None)
            await _reserve(channel, "a", 2 * BIG)
            with pytest.raises(LimitExceeded, match="bytes registered"):
                await _reserve(channel, "b", 2 * BIG)
            assert _registered(server) == 1
            await channel.close()
        finally:
            await server.close()

    run(case())


def test_stored_bytes_are_never_registered() -> None:
    """A get serves a private copy: an engine peer writing into the address it learnt changes the
    copy, never the stored tensor (and the client's chunk checksums catch the change)."""

    async def case() -> None:
        server = await _server()
        try:
            channel = await _channel(server, None)
            assert isinstance(channel, RdmaTransport)
            stored = torch.arange(BIG, dtype=torch.int64).to(torch.uint8)
            await _put(channel, "kept", stored)
            reader = await channel.call(
                Opcode.RDMA_GET, wr.encode_get_request(1 << 20, ["kept"]), sink=lambda m: [], what="get"
            )
            reservation = reader.u64()
            refs = wr.decode_refs(reader, 1, 1 << 20)
            stored_view = server.store.acquire(["kept"])[0]
            server.store.release([stored_view])
            assert address_of(stored_view.data) not in _service(server).engine.registered
            junk = torch.full((BIG,), 0xEE, dtype=torch.uint8)
            with channel.cache.using(memoryview(junk.numpy()).cast("B")) as local:
                await channel.engine.write(channel.peer.session, local, refs[0].address, BIG, timeout=10.0)
            assert bytes(stored_view.data[:16]) == bytes(stored.numpy()[:16])
            await channel.call(Opcode.RDMA_END, wr.encode_end(reservation, wr.End.RELEASE), what="release")
            await channel.close()
        finally:
            await server.close()

    run(case())


async def _put(channel: RdmaTransport, name: str, tensor: torch.Tensor) -> None:
    await channel.put(TensorBatch([(name, tensor)]))


async def _until(check: object, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
