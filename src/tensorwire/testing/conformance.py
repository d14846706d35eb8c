"""The transport conformance suite: every case runs against every transport.

Each case is an ``async def case(h: Harness) -> None`` that starts what it needs (a real server on
the harness's transport, or a hand-written peer) on the running event loop and asserts with plain
``assert``. ``run_case(case, scheme)`` runs one on a fresh loop; ``CASES`` lists them all, so a
test module parametrizes ``CASES x schemes`` (see tests/integration/test_conformance.py).

Cases cover round trips of every dtype and shape, in-place gets, batches, concurrency, timeouts,
close, and frames that are corrupt, truncated, over a limit or otherwise hostile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tensorwire import errors, transport
from tensorwire._aio import run
from tensorwire.client.core import AsyncClient, ClientOptions
from tensorwire.security import Security, TlsFiles, write_dev_certs
from tensorwire.server.core import Server
from tensorwire.store import TensorStore
from tensorwire.store.memory import entry_cost
from tensorwire.transport.base import ByteStream
from tensorwire.transport.frame_io import FrameReader, read_head, send_frame
from tensorwire.types import Address, Limits, TensorMeta
from tensorwire.wire import lossless
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.dtypes import SUPPORTED_DTYPES
from tensorwire.wire.frame import HEADER_BYTES, Flags, Header, Opcode, decode_header, encode_frame_head
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
        return self.scheme in ("tls", "grpcs")

    @contextlib.asynccontextmanager
    async def server(
        self, capacity: int = 1 << 30, limits: Limits | None = None, **options: Any
    ) -> AsyncIterator[Server]:
        if self.secure:
            options.setdefault("security", Security(TlsFiles(_certs()["server"], _certs()["server_key"])))
        server = Server(TensorStore(capacity), limits, **options)
        await server.start(self.fresh_url())
        try:
            yield server
        finally:
            await server.close()

    @contextlib.asynccontextmanager
    async def client(self, server: Server, **options: object) -> AsyncIterator[AsyncClient]:
        opts = {"timeout": 10.0, "connect_timeout": 5.0, "compression": self.compression, **options}
        if self.secure:
            opts["tls_ca"] = str(_certs()["ca"])
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


# -- round trips -------------------------------------------------------------------------------
async def every_dtype_and_shape(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        for dtype in SUPPORTED_DTYPES:
            for shape in [(), (0, 3), (7,), (2, 3, 4)]:
                x = random_tensor(dtype, shape)
                await c.put(f"t/{dtype}/{len(shape)}", x)
                y = await c.get(f"t/{dtype}/{len(shape)}")
                assert same_bytes(x, y), f"{dtype} {shape} did not round-trip"


async def non_contiguous_is_sent_contiguous(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        x = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
        assert not x.is_contiguous()
        await c.put("nc", x)
        y = await c.get("nc")
        assert y.is_contiguous() and torch.equal(x, y)


async def get_into_out_in_place(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        x = torch.randn(1000, 33)
        await c.put("w", x)
        out = torch.zeros(1000, 33)
        ptr = out.data_ptr()
        got = await c.get("w", out=out)
        assert got is out and out.data_ptr() == ptr and torch.equal(out, x)
        strided = torch.zeros(33, 1000).t()  # a non-contiguous out is filled too
        await c.get("w", out=strided)
        assert torch.equal(strided, x)


async def out_mismatch_is_refused(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        await c.put("w", torch.ones(4))
        for bad in (torch.zeros(5), torch.zeros(4, dtype=torch.float64)):
            try:
                await c.get("w", out=bad)
            except errors.InvalidTensor:
                pass
            else:
                raise AssertionError("a mismatched out was accepted")
        assert torch.equal(await c.get("w"), torch.ones(4))  # the connection still works


async def large_tensor_many_chunks(h: Harness) -> None:
    async with h.server() as srv, h.client(srv, chunk_size=1 << 20) as c:
        x = random_tensor(torch.float32, (9 * (1 << 18) + 5,))  # 9 MiB + 20 bytes: 10 chunks
        await c.put("big", x)
        assert same_bytes(await c.get("big"), x)


async def compressible_and_mixed_tensors_round_trip(h: Harness) -> None:
    """Sparse (compressible) and random (incompressible) data in one batch and alone: with chunk
    compression on, chunks go compressed or raw, and every byte comes back the same."""
    async with h.server() as srv, h.client(srv, chunk_size=1 << 20) as c:
        sparse = torch.zeros(3 * (1 << 18) + 7)
        sparse[::11] = torch.randn(sparse[::11].numel())
        noise = random_tensor(torch.float32, (1 << 18,))
        await c.put_many(
            {"sparse": sparse, "noise": noise, "int8": torch.randint(-3, 3, (999_999,)).to(torch.int8)}
        )
        got = await c.get_many(["sparse", "noise", "int8"])
        assert same_bytes(got["sparse"], sparse) and same_bytes(got["noise"], noise)
        out = torch.empty_like(sparse)
        await c.get("sparse", out=out)
        assert same_bytes(out, sparse)


async def a_batch_in_many_frames_is_one_put(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        items = {f"big/{i:05d}": torch.full((3,), float(i)) for i in range(2500)}  # three frames
        version = await c.put_many(items)
        metas = await c.list("big/")
        assert len(metas) == 2500 and {m.version for m in metas} == {version}
        got = await c.get_many(list(items))
        assert all(torch.equal(got[k], v) for k, v in items.items())


async def a_bad_part_refuses_the_whole_batch(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        ok = TensorMeta("p/ok", torch.uint8, (2,), 2)
        bad = TensorMeta("p/../escape", torch.uint8, (2,), 2)
        await stream.send([put_frame([ok], b"ab", rid=3, flags=Flags.MORE)])
        await stream.send([put_frame([bad], b"cd", rid=3, flags=Flags.MORE)])
        after = TensorMeta("p/after", torch.uint8, (5000,), 5000)  # a part after the refused one
        await stream.send([put_frame([after], bytes(5000), rid=3, flags=Flags.MORE)])
        await stream.send([put_frame([TensorMeta("p/last", torch.uint8, (1,), 1)], b"e", rid=3)])
        await expect_error(reader, errors.ErrorCode.INVALID_NAME)  # one answer, for the whole batch
        await stream.send([put_frame([ok], b"ab", rid=4)])  # the session goes on
        header, _ = await read_reply(reader)
        assert not header.is_error and header.request_id == 4
        async with h.client(srv) as c:
            assert [m.name for m in await c.list()] == ["p/ok"]


async def an_unfinished_batch_stores_nothing(h: Harness) -> None:
    async with h.server(capacity=1 << 20) as srv:
        async with raw(srv) as (stream, reader):
            part = TensorMeta("u/a", torch.uint8, (600_000,), 600_000)
            await stream.send([put_frame([part], bytes(600_000), rid=5, flags=Flags.MORE)])
            # another request in the middle of the batch: refused, and the connection is dropped
            await stream.send([put_frame([TensorMeta("u/b", torch.uint8, (1,), 1)], b"x", rid=6)])
            await expect_error(reader, errors.ErrorCode.PROTOCOL_ERROR)
            assert not await asyncio.wait_for(reader.at_frame_start(), 5), "session stayed open"
        async with raw(srv) as (stream, reader):  # any other request in the middle: the same
            await stream.send([put_frame([part], bytes(600_000), rid=5, flags=Flags.MORE)])
            ping = Header(1, Opcode.PING, 0, ChecksumKind.XXH3_64, 9, 0, 4096, 0)
            await stream.send([encode_frame_head(ping, b"")])
            await expect_error(reader, errors.ErrorCode.PROTOCOL_ERROR)
            assert not await asyncio.wait_for(reader.at_frame_start(), 5), "session stayed open"
        async with raw(srv) as (stream, reader):  # an unknown opcode in the middle: the same
            await stream.send([put_frame([part], bytes(600_000), rid=5, flags=Flags.MORE)])
            odd = Header(1, 77, 0, ChecksumKind.XXH3_64, 6, 0, 4096, 0)
            await stream.send([encode_frame_head(odd, b"")])
            await expect_error(reader, errors.ErrorCode.PROTOCOL_ERROR)
            assert not await asyncio.wait_for(reader.at_frame_start(), 5), "session stayed open"
        async with raw(srv) as (stream, reader):  # MORE on anything but PUT_MANY is refused
            more_ping = Header(1, Opcode.PING, Flags.MORE, ChecksumKind.XXH3_64, 11, 0, 4096, 0)
            await stream.send([encode_frame_head(more_ping, b"")])
            await expect_error(reader, errors.ErrorCode.PROTOCOL_ERROR)
        async with raw(srv) as (stream, _):  # a batch cut off by a closed connection
            await stream.send([put_frame([part], bytes(600_000), rid=5, flags=Flags.MORE)])
        async with h.client(srv) as c:
            await _until_stored(c, "u/full", torch.zeros(1000_000, dtype=torch.uint8))
            assert [m.name for m in await c.list()] == ["u/full"]  # both reservations were freed


async def a_stalled_request_is_cut_off(h: Harness) -> None:
    async with h.server(capacity=1 << 20, stall_timeout=0.5) as srv:
        async with raw(srv) as (stream, reader):
            idle_since = time.monotonic()
            await stream.send([put_frame([TensorMeta("s/x", torch.uint8, (1,), 1)], b"x", rid=1)])
            await read_reply(reader)  # a finished request, then idleness: never cut off
            frame = put_frame([TensorMeta("s/big", torch.uint8, (900_000,), 900_000)], bytes(900_000), rid=2)
            await asyncio.sleep(0.8)  # idle for longer than the stall timeout, on purpose
            await stream.send([frame[: len(frame) // 3]])  # then a third of a request, and silence
            assert not await asyncio.wait_for(reader.at_frame_start(), 5), "a stalled request was kept"
            assert time.monotonic() - idle_since > 0.8
        async with h.client(srv) as c:
            await c.delete("s/x")
            await c.put("s/full", torch.zeros(1000_000, dtype=torch.uint8))  # the reservation is free


async def connections_are_bounded_and_idle_ones_dropped(h: Harness) -> None:
    async with h.server(max_connections=2, idle_timeout=0.3) as srv:
        async with raw(srv) as (one, one_reader), raw(srv) as (two, _):
            ping = Header(1, Opcode.PING, 0, ChecksumKind.XXH3_64, 1, 0, 4096, 0)
            await one.send([encode_frame_head(ping, b"")])
            await read_reply(one_reader)  # both sessions exist now
            await two.send([encode_frame_head(ping, b"")])
            async with raw(srv) as (_, third_reader):
                await expect_error(third_reader, errors.ErrorCode.LIMIT_EXCEEDED)
                assert not await asyncio.wait_for(third_reader.at_frame_start(), 5)
            # then both sit idle: each is closed after idle_timeout, well within this wait
            assert not await asyncio.wait_for(one_reader.at_frame_start(), 5), "an idle session was kept"
        async with h.client(srv) as c:  # room again; a client reconnects without noticing
            await c.ping()
            await asyncio.sleep(0.6)  # idle past the timeout, on purpose
            await c.ping()


async def a_get_naming_a_tensor_twice_is_refused(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        await stream.send([put_frame([TensorMeta("g/x", torch.uint8, (3,), 3)], b"abc", rid=1)])
        await read_reply(reader)
        names = wm.encode_names(["g/x"] * 1000)  # one small tensor, asked for 1000 times
        get = Header(1, Opcode.GET_MANY, 0, ChecksumKind.XXH3_64, 2, len(names), 4096, 0)
        await stream.send([encode_frame_head(get, names)])
        await expect_error(reader, errors.ErrorCode.PROTOCOL_ERROR)


async def an_unauthenticated_peer_cannot_make_the_server_allocate(h: Harness) -> None:
    async with h.server(security=Security(token="t0ken")) as srv, raw(srv) as (stream, reader):
        # A header that announces an 8 MiB metadata block, then one byte: refused at once.
        hello = bytearray(encode_frame_head(Header(1, Opcode.HELLO, 0, 1, 1, 0, 4096, 0), b""))
        hello[16:20] = (8 << 20).to_bytes(4, "little")  # meta_len: 8 MiB promised, 1 byte sent
        await stream.send([hello, b"x"])
        await expect_error(reader, errors.ErrorCode.UNAUTHENTICATED)
        assert not await asyncio.wait_for(reader.at_frame_start(), 5), "session stayed open"


async def _until_stored(c: AsyncClient, name: str, tensor: torch.Tensor, timeout: float = 5.0) -> None:
    """Put until the server has room: a dead connection's reservation is freed when the server
    notices the connection is gone, which may take a moment after the client closed it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await c.put(name, tensor)
            return
        except errors.CapacityExceeded:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.01)


async def batches_are_atomic_and_versioned(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        items = {f"b/{i}": torch.full((i + 1,), float(i)) for i in range(50)}
        version = await c.put_many(items)
        metas = await c.list("b/")
        assert len(metas) == 50 and {m.version for m in metas} == {version}
        got = await c.get_many(list(items))
        assert all(torch.equal(got[k], v) for k, v in items.items())
        newer = await c.put("b/0", torch.zeros(1))
        assert newer > version and (await c.stat("b/0")).version == newer
        try:  # one bad name refuses the whole batch
            await c.put_many({"b/ok": torch.ones(1), "b/../x": torch.ones(1)})
        except errors.InvalidName:
            pass
        else:
            raise AssertionError("a batch with an invalid name was accepted")
        assert [m.name for m in await c.list("b/ok")] == []


async def list_stat_delete(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        await c.put_many({"m/a": torch.ones(2, 3), "m/b": torch.ones(1), "n/c": torch.ones(1)})
        assert [m.name for m in await c.list("m/")] == ["m/a", "m/b"]
        meta = await c.stat("m/a")
        assert (meta.dtype, meta.shape, meta.nbytes) == (torch.float32, (2, 3), 24)
        await c.delete("m/a")
        for op in (c.get("m/a"), c.stat("m/a"), c.delete("m/a"), c.delete_many(["m/b", "zz"])):
            try:
                await op
            except errors.KeyNotFound:
                pass
            else:
                raise AssertionError("an operation on a missing key succeeded")
        assert [m.name for m in await c.list()] == ["m/b", "n/c"]  # delete_many removed nothing


async def capacity_is_enforced(h: Harness) -> None:
    async with h.server(capacity=1 << 20) as srv, h.client(srv) as c:
        await c.put("fits", torch.zeros(1 << 17))  # 512 KiB
        try:
            await c.put("too-big", torch.zeros(1 << 18))  # 1 MiB more
        except errors.CapacityExceeded:
            pass
        else:
            raise AssertionError("capacity was not enforced")
        assert [m.name for m in await c.list()] == ["fits"]
        await c.delete("fits")
        await c.put("too-big", torch.zeros((1 << 18) - 1024))  # the space came back (less a name's cost)


async def many_requests_in_flight(h: Harness) -> None:
    async with h.server() as srv, h.client(srv) as c:
        tensors = {f"c/{i}": torch.randn(1000 + i) for i in range(40)}
        await asyncio.gather(*(c.put(k, v) for k, v in tensors.items()))
        got = await asyncio.gather(*(c.get(k) for k in tensors))
        assert all(torch.equal(g, v) for g, v in zip(got, tensors.values(), strict=True))


# -- timeouts and close -----------------------------------------------------------------------
async def silent_server_times_out(h: Harness) -> None:
    async with h.black_hole() as url:
        client = AsyncClient(url, ClientOptions(timeout=0.3, connect_timeout=0.3, retries=1, backoff=0.01))
        start = time.monotonic()
        try:
            await client.ping()
        except (errors.TransferTimeout, errors.ConnectError) as exc:
            assert any(w in str(exc) for w in ("HELLO", "ping", "connect", "handshake")), exc
        else:
            raise AssertionError("a silent server did not time out")
        finally:
            await client.close()
        assert time.monotonic() - start < 5


async def closed_client_and_server(h: Harness) -> None:
    async with h.server() as srv:
        async with h.client(srv, retries=1, backoff=0.01, connect_timeout=1.0) as c:
            await c.put("x", torch.ones(1))
            await srv.close()  # the server goes away under a connected client
            try:
                await c.get("x")
            except errors.TransportError:
                pass
            else:
                raise AssertionError("a call to a closed server succeeded")
        try:
            await c.ping()
        except errors.ConnectError:
            pass
        else:
            raise AssertionError("a closed client still worked")


# -- hostile and broken frames ----------------------------------------------------------------
@contextlib.asynccontextmanager
async def raw(srv: Server) -> AsyncIterator[tuple[ByteStream, FrameReader]]:
    stream = await transport.connect_stream(srv.addresses[0], 5.0)
    try:
        yield stream, FrameReader(stream)
    finally:
        await stream.close()


async def read_reply(reader: FrameReader) -> tuple[Header, wm.MetaReader]:
    raw_head = await asyncio.wait_for(read_head(reader), 5)
    header = decode_header(raw_head, Limits(max_meta_bytes=1 << 30))
    meta = await reader.read(header.meta_len)
    return header, wm.MetaReader(meta, Limits())


async def expect_error(reader: FrameReader, code: errors.ErrorCode) -> None:
    header, meta = await read_reply(reader)
    assert header.is_error, "expected an ERROR frame"
    got, message = wm.decode_error(meta)
    assert got == code, f"expected {code.name}, got {errors.ErrorCode(got).name}: {message}"


def put_frame(
    meta_list: list[TensorMeta], data: bytes, rid: int = 7, chunk: int = 4096, flags: int = 0
) -> bytearray:
    """A PUT_MANY frame built by hand: header, records, data chunks and their xxh3 trailers."""
    meta = wm.encode_records(meta_list)
    header = Header(1, Opcode.PUT_MANY, flags, ChecksumKind.XXH3_64, rid, len(meta), chunk, len(data))
    out = bytearray(encode_frame_head(header, meta))
    for i in range(0, len(data), chunk):
        piece = data[i : i + chunk]
        out += piece + struct.pack("<Q", checksum(ChecksumKind.XXH3_64, piece))
    return out


def compressed_put_frame(
    meta_list: list[TensorMeta], data: bytes, rid: int = 7, chunk: int = 4096
) -> bytearray:
    """A PUT_MANY frame with flag COMPRESSED: each chunk lz4-compressed behind its chunk head."""
    meta = wm.encode_records(meta_list)
    header = Header(
        1, Opcode.PUT_MANY, Flags.COMPRESSED, ChecksumKind.XXH3_64, rid, len(meta), chunk, len(data)
    )
    out = bytearray(encode_frame_head(header, meta))
    for i in range(0, len(data), chunk):
        piece = data[i : i + chunk]
        payload = lossless.compress(lossless.Codec.LZ4, piece)
        out += lossless.CHUNK_HEAD.pack(lossless.Codec.LZ4, len(payload)) + payload
        out += struct.pack("<Q", checksum(ChecksumKind.XXH3_64, piece))
    return out


async def assert_alive_and_empty(srv: Server, h: Harness) -> None:
    """The server still answers a new client, and nothing was stored."""
    async with h.client(srv) as c:
        await c.ping()
        assert await c.list() == []


async def still_serves(stream: ByteStream, reader: FrameReader) -> None:
    """The same connection keeps working after an error: a small put on it is stored."""
    await stream.send([put_frame([TensorMeta("ok", torch.uint8, (3,), 3)], b"abc", rid=8)])
    header, _ = await read_reply(reader)
    assert not header.is_error and header.request_id == 8


async def corrupt_chunk_is_never_stored(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        data = bytes(range(256)) * 40
        frame = put_frame([TensorMeta("victim", torch.uint8, (len(data),), len(data))], data)
        frame[-100] ^= 0x40  # a flipped bit in the last chunk
        await stream.send([frame])
        await expect_error(reader, errors.ErrorCode.CORRUPT_FRAME)
        await still_serves(stream, reader)
        async with h.client(srv) as c:
            assert [m.name for m in await c.list()] == ["ok"]


async def corrupt_compressed_chunk_is_never_stored(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        data = bytes(8192) + bytes(range(256)) * 16
        victim = [TensorMeta("victim", torch.uint8, (len(data),), len(data))]
        await stream.send([compressed_put_frame(victim, data, rid=5)])
        header, _ = await read_reply(reader)  # a well-formed compressed put is stored
        assert not header.is_error and header.request_id == 5
        frame = compressed_put_frame([TensorMeta("bad", torch.uint8, (len(data),), len(data))], data)
        frame[-12] ^= 0x40  # a flipped bit in the last chunk's compressed bytes
        await stream.send([frame])
        await expect_error(reader, errors.ErrorCode.CORRUPT_FRAME)
        await still_serves(stream, reader)
        async with h.client(srv) as c:
            assert [m.name for m in await c.list()] == ["ok", "victim"]
            assert bytes(byte_view(await c.get("victim"))) == data


async def a_lying_chunk_head_ends_the_session(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        data = bytes(4096)
        frame = compressed_put_frame([TensorMeta("x", torch.uint8, (4096,), 4096)], data)
        head = HEADER_BYTES + len(wm.encode_records([TensorMeta("x", torch.uint8, (4096,), 4096)]))
        frame[head + 1 : head + 5] = struct.pack("<I", 1 << 30)  # announces a GiB for a 4 KiB chunk
        await stream.send([frame])
        assert not await asyncio.wait_for(reader.at_frame_start(), 5), "session stayed open"
        await assert_alive_and_empty(srv, h)


async def a_partial_striped_put_is_never_visible(h: Harness) -> None:
    """PUT_RANGE writes land in an upload; only a PUT_COMMIT of ranges that tile the tensor makes
    it visible, and a commit with a range missing is refused."""
    async with h.server() as srv, raw(srv) as (stream, reader), h.client(srv) as c:
        data = bytes(range(256)) * 64  # 16 KiB, as two ranges of 8 KiB
        meta = TensorMeta("striped", torch.uint8, (len(data),), len(data))

        async def request(opcode: int, block: bytes, payload: bytes = b"", rid: int = 1) -> Header:
            header = Header(1, opcode, 0, ChecksumKind.XXH3_64, rid, len(block), 4096, len(payload))
            await send_frame(stream, header, block, [payload] if payload else [])
            return (await read_reply(reader))[0]

        assert not (await request(Opcode.PUT_RANGE, wm.encode_resumable(9, 0, meta), data[:8192])).is_error
        try:
            await c.stat("striped")
        except errors.KeyNotFound:
            pass
        else:
            raise AssertionError("half a striped put is visible")
        assert (await request(Opcode.PUT_COMMIT, wm.encode_resumable(9, 0, meta), rid=2)).is_error
        assert not (
            await request(Opcode.PUT_RANGE, wm.encode_resumable(9, 8192, meta), data[8192:], 3)
        ).is_error
        assert not (await request(Opcode.PUT_COMMIT, wm.encode_resumable(9, 0, meta), rid=4)).is_error
        assert bytes(byte_view(await c.get("striped"))) == data
        stale = wm.encode_get_range(99, 0, 10, "striped")
        header = await request(Opcode.GET_RANGE, stale, rid=5)
        assert header.is_error  # a range of a version that is gone: VERSION_CHANGED


async def bad_magic_and_version_end_the_session(h: Harness) -> None:
    async with h.server() as srv:
        for offset, value, code in (
            (0, ord("X"), errors.ErrorCode.PROTOCOL_ERROR),
            (4, 99, errors.ErrorCode.UNSUPPORTED_VERSION),
        ):
            async with raw(srv) as (stream, reader):
                frame = put_frame([TensorMeta("x", torch.uint8, (1,), 1)], b"z")
                frame[offset] = value
                await stream.send([frame])
                await expect_error(reader, code)
                assert not await asyncio.wait_for(reader.at_frame_start(), 5), "session stayed open"
        await assert_alive_and_empty(srv, h)


async def damaged_header_is_caught(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        frame = put_frame([TensorMeta("x", torch.uint8, (4,), 4)], b"abcd")
        frame[24] ^= 0x01  # data_len off by one: the header CRC must catch it before it is trusted
        await stream.send([frame])
        await expect_error(reader, errors.ErrorCode.CORRUPT_FRAME)
        await assert_alive_and_empty(srv, h)


async def truncated_frame_stores_nothing(h: Harness) -> None:
    async with h.server() as srv:
        async with raw(srv) as (stream, _):
            data = bytes(100_000)
            frame = put_frame([TensorMeta("half", torch.uint8, (len(data),), len(data))], data)
            await stream.send([frame[: len(frame) // 2]])
        await assert_alive_and_empty(srv, h)


async def limits_are_enforced(h: Harness) -> None:
    limits = Limits(max_meta_bytes=4096, max_ndim=4, max_request_bytes=1 << 20)
    async with h.server(limits=limits) as srv:
        async with raw(srv) as (stream, reader):  # too many dims: refused, session goes on
            meta = TensorMeta("d", torch.uint8, (1, 1, 1, 1, 1), 1)
            await stream.send([put_frame([meta], b"x")])
            await expect_error(reader, errors.ErrorCode.LIMIT_EXCEEDED)
            await stream.send([put_frame([TensorMeta("e", torch.uint8, (1,), 1)], b"y", rid=9)])
            header, _ = await read_reply(reader)
            assert not header.is_error
        for field, value in ((16, 1 << 20), (24, 1 << 40)):  # meta_len / data_len over the limit
            async with raw(srv) as (stream, reader):
                frame = bytearray(put_frame([TensorMeta("x", torch.uint8, (1,), 1)], b"z"))
                width = 4 if field == 16 else 8
                frame[field : field + width] = value.to_bytes(width, "little")
                await stream.send([frame[:40]])
                await expect_error(reader, errors.ErrorCode.LIMIT_EXCEEDED)


async def lying_records_are_refused(h: Harness) -> None:
    async with h.server() as srv, raw(srv) as (stream, reader):
        # shape says 8 bytes, nbytes says 4: refused, and nothing is stored
        lie = wm.encode_records([TensorMeta("l", torch.uint8, (4,), 4)])
        lie = lie[:-16] + struct.pack("<QQ", 8, 0)
        header = Header(1, Opcode.PUT, 0, ChecksumKind.XXH3_64, 3, len(lie), 4096, 8)
        body = bytes(8) + struct.pack("<Q", checksum(ChecksumKind.XXH3_64, bytes(8)))
        await stream.send([encode_frame_head(header, lie) + body])
        await expect_error(reader, errors.ErrorCode.INVALID_TENSOR)
        # an unknown dtype code
        rec = bytearray(wm.encode_records([TensorMeta("u", torch.uint8, (1,), 1)]))
        rec[4 + 2 + 1] = 250
        header = Header(1, Opcode.PUT, 0, ChecksumKind.XXH3_64, 4, len(rec), 4096, 1)
        body = b"q" + struct.pack("<Q", checksum(ChecksumKind.XXH3_64, b"q"))
        await stream.send([encode_frame_head(header, bytes(rec)) + body])
        await expect_error(reader, errors.ErrorCode.INVALID_TENSOR)
        # a name that escapes
        await stream.send([put_frame([TensorMeta("../../etc/passwd", torch.uint8, (1,), 1)], b"x", rid=5)])
        await expect_error(reader, errors.ErrorCode.INVALID_NAME)
        await assert_alive_and_empty(srv, h)


async def corrupt_get_response_is_retried(h: Harness) -> None:
    """A peer that damages its first GET answer: the client must not return it, and must retry."""
    payload = torch.arange(1000, dtype=torch.int32)
    answers = 0

    async def flaky(stream: ByteStream) -> None:
        nonlocal answers
        reader = FrameReader(stream)
        while await reader.at_frame_start():
            raw_head = await read_head(reader)
            req = decode_header(raw_head, Limits())
            await reader.read(req.meta_len)
            if req.opcode == Opcode.HELLO:
                info = wm.ServerInfo(1, Limits(), 1 << 30, 0)
                meta = wm.encode_hello_response(info)
                data: list[memoryview] = []
            else:
                answers += 1
                meta = wm.encode_records([TensorMeta.of("p", payload).with_version(1)])
                data = [byte_view(payload.clone())]
                if answers == 1:
                    data[0][10] ^= 0xFF  # the checksum is computed after: damage "in transit"
            header = Header(1, req.opcode, Flags.RESPONSE, req.checksum, req.request_id, len(meta), 4096,
                            sum(d.nbytes for d in data))  # fmt: skip
            if data and answers == 1:
                await _send_damaged(stream, header, meta, data[0], payload)
            else:
                await send_frame(stream, header, meta, data)

    async with h.peer(flaky) as url:
        client = AsyncClient(url, ClientOptions(timeout=5, retries=2, backoff=0.01))
        try:
            got = await client.get("p")
        finally:
            await client.close()
    assert answers == 2 and torch.equal(got, payload)


async def _send_damaged(
    stream: ByteStream, header: Header, meta: bytes, damaged: memoryview, good: torch.Tensor
) -> None:
    """Send ``damaged`` bytes with the trailers of ``good``: a corruption the checksums must catch."""
    good_view = byte_view(good)
    out = bytearray(encode_frame_head(header, meta))
    for i in range(0, header.data_len, header.chunk_size):
        out += damaged[i : i + header.chunk_size]
        out += struct.pack("<Q", checksum(header.checksum, good_view[i : i + header.chunk_size]))
    await stream.send([out])


# -- hostile input on gRPC ------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def raw_rpc(srv: Server) -> AsyncIterator[Callable[[list[bytes]], Awaitable[tuple[str, int]]]]:
    """``put(chunks)`` sends hand-made Put chunks; returns (status name, tensorwire error code)."""
    import grpc

    from tensorwire.wire.rpc import ERROR_KEY, SERVICE

    address = srv.addresses[0]
    async with grpc.aio.insecure_channel(f"{address.host}:{address.port}") as channel:
        call = channel.stream_unary(f"/{SERVICE}/Put", None, None)

        async def put(chunks: list[bytes]) -> tuple[str, int]:
            try:
                await call(iter(chunks), timeout=5)
            except grpc.aio.AioRpcError as exc:
                codes = [int(v) for k, v in exc.trailing_metadata() or () if k == ERROR_KEY]
                return exc.code().name, codes[0] if codes else 0
            return "OK", 0

        yield put


async def _until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout}s for {what}")
        await asyncio.sleep(0.02)


async def rpc_a_stalled_put_is_cut_off(h: Harness) -> None:
    from tensorwire.v1 import tensor_service_pb2 as pb
    from tensorwire.wire.rpc import encode_chunk

    # 1 s, not less: every call on this server has the same stall timeout, the healthy ones too,
    # and a loaded test machine can pause a healthy call for a few hundred milliseconds.
    async with h.server(capacity=1 << 20, stall_timeout=1.0) as srv:
        address = srv.addresses[0]
        import grpc

        from tensorwire.wire.rpc import SERVICE

        async with grpc.aio.insecure_channel(f"{address.host}:{address.port}") as channel:
            call = channel.stream_unary(f"/{SERVICE}/Put", None, None)(timeout=30)
            info = pb.TensorInfo(name="st/x", dtype="uint8", shape=[900_000], nbytes=900_000)
            first = memoryview(bytes(1000))
            await call.write(encode_chunk(first, 1, checksum(1, first), info))  # then silence
            reserved = 900_000 + entry_cost("st/x")  # the tensor and its name's cost
            await _until(lambda: srv.store.used == reserved, "the stalled Put's reservation")
            await _until(lambda: srv.store.used == 0, "the stalled Put to be cut off and freed")
            async with h.client(srv) as c:
                await c.put("st/full", torch.zeros(1000_000, dtype=torch.uint8))  # the room is back
            call.cancel()


async def rpc_hostile_puts_store_nothing(h: Harness) -> None:
    from tensorwire.v1 import tensor_service_pb2 as pb
    from tensorwire.wire.rpc import encode_chunk

    info = pb.TensorInfo(name="r/x", dtype="uint8", shape=[8], nbytes=8)
    data = memoryview(bytes(range(8)))
    good = checksum(ChecksumKind.XXH3_64, data)
    cases = {
        "corrupt chunk": ([encode_chunk(data, 1, good ^ 1, info)], errors.ErrorCode.CORRUPT_FRAME),
        "bytes before a header": ([encode_chunk(data, 1, good)], errors.ErrorCode.PROTOCOL_ERROR),
        "a tensor cut short": (
            [encode_chunk(data[:4], 1, checksum(1, data[:4]), info)],
            errors.ErrorCode.INVALID_TENSOR,
        ),
        "size and shape disagree": (
            [encode_chunk(data, 1, good, pb.TensorInfo(name="r/x", dtype="float32", shape=[8], nbytes=8))],
            errors.ErrorCode.INVALID_TENSOR,
        ),
        "an escaping name": (
            [encode_chunk(data, 1, good, pb.TensorInfo(name="../x", dtype="uint8", shape=[8], nbytes=8))],
            errors.ErrorCode.INVALID_NAME,
        ),
        "not protobuf at all": ([b"\xff\xff\xff"], errors.ErrorCode.PROTOCOL_ERROR),
        "unknown checksum kind": ([encode_chunk(data, 9, good, info)], errors.ErrorCode.PROTOCOL_ERROR),
    }
    async with h.server() as srv, raw_rpc(srv) as put:
        for what, (chunks, code) in cases.items():
            status, got = await put(chunks)
            assert got == code, f"{what}: expected {code.name}, got {status} / {got}"
        assert await put([encode_chunk(data, 1, good, info)]) == ("OK", 0)  # still serving
        async with h.client(srv) as c:
            assert [m.name for m in await c.list()] == ["r/x"]


RPC_CASES: list[Case] = [rpc_hostile_puts_store_nothing, rpc_a_stalled_put_is_cut_off]


# Cases every transport must pass, through the public client API.
CASES: list[Case] = [
    every_dtype_and_shape,
    non_contiguous_is_sent_contiguous,
    get_into_out_in_place,
    out_mismatch_is_refused,
    large_tensor_many_chunks,
    batches_are_atomic_and_versioned,
    a_batch_in_many_frames_is_one_put,
    compressible_and_mixed_tensors_round_trip,
    list_stat_delete,
    capacity_is_enforced,
    many_requests_in_flight,
    silent_server_times_out,
    closed_client_and_server,
]

# Hostile and broken input in the frame protocol's own bytes (tcp://, memory://).
STREAM_CASES: list[Case] = [
    a_bad_part_refuses_the_whole_batch,
    an_unfinished_batch_stores_nothing,
    a_stalled_request_is_cut_off,
    connections_are_bounded_and_idle_ones_dropped,
    a_get_naming_a_tensor_twice_is_refused,
    an_unauthenticated_peer_cannot_make_the_server_allocate,
    corrupt_chunk_is_never_stored,
    corrupt_compressed_chunk_is_never_stored,
    a_lying_chunk_head_ends_the_session,
    a_partial_striped_put_is_never_visible,
    bad_magic_and_version_end_the_session,
    damaged_header_is_caught,
    truncated_frame_stores_nothing,
    limits_are_enforced,
    lying_records_are_refused,
    corrupt_get_response_is_retried,
]
STREAM_SCHEMES = ("memory", "tcp")

__all__ = [
    "CASES",
    "RPC_CASES",
    "SCHEMES",
    "STREAM_CASES",
    "STREAM_SCHEMES",
    "Harness",
    "random_tensor",
    "run_case",
    "same_bytes",
]
