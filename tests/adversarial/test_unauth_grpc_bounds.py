"""gRPC requests are held to the same limits as frames (issue 13, sweep).

A Delete or Stat names at most ``Limits.max_batch`` tensors, as DELETE and STAT frames do: a
peer cannot make one call walk millions of names on the server's event loop.
"""

from __future__ import annotations

import asyncio

import grpc

from tensorwire.server import Server
from tensorwire.server.options import ServerOptions
from tensorwire.store import TensorStore
from tensorwire.types import Limits
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.v1 import tensor_service_pb2_grpc as pb_grpc


def test_name_lists_are_bounded_by_max_batch() -> None:
    async def main() -> None:
        server = Server(ServerOptions(limits=Limits(max_batch=10)), store=TensorStore(1 << 20))
        await server.start("grpc://127.0.0.1:0")
        try:
            address = server.addresses[0]
            async with grpc.aio.insecure_channel(f"{address.host}:{address.port}") as channel:
                stub = pb_grpc.TensorServiceStub(channel)  # type: ignore[no-untyped-call]
                upload = pb.TensorRequest(tensor_name="b/x", data=bytes(8), shape=[8], dtype="uint8")
                assert (await stub.UploadTensor(upload, timeout=10)).success
                for call in (stub.Delete, stub.Stat):
                    try:
                        await call(pb.NamesRequest(names=[f"b/{i}" for i in range(11)]), timeout=10)
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.OUT_OF_RANGE
                        assert "exceed 10" in (exc.details() or "")
                    else:
                        raise AssertionError(f"{call} took 11 names under max_batch=10")
                reply = await stub.Stat(pb.NamesRequest(names=["b/x"]), timeout=10)
                assert [t.name for t in reply.tensors] == ["b/x"]
                assert server.store.reserved == 0
        finally:
            await server.close()

    asyncio.run(main())
