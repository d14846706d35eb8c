"""Hostile input on gRPC: hand-made Put chunks and a stalled Put, spoken with grpcio directly."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import torch

from tensorwire import Server, errors
from tensorwire.server.options import ConnectionOptions
from tensorwire.store.memory import entry_cost
from tensorwire.testing.conformance.harness import Harness
from tensorwire.wire.checksum import ChecksumKind, checksum


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
    async with h.server(capacity=1 << 20, connections=ConnectionOptions(stall_timeout=1.0)) as srv:
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
