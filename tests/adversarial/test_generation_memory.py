"""Memory a reader of generations makes the server hold counts against the store's one capacity
(issue 32, class 5): a delta answer's encoded deltas while a reader that does not read keeps them
(and they are given back when it goes), full chunks instead of deltas where there is no room, and
a manifest's encoding, a gRPC GetRanges message. Real servers on loopback; the slow reader is a
raw socket (or gRPC call) that asks and never reads."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
import torch

import tensorwire
from tensorwire.errors import CapacityExceeded
from tensorwire.store import TensorStore
from tensorwire.store.memory import entry_cost
from tensorwire.testing.process import wait_for
from tensorwire.types import Address, MiB
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.wire import delta_reads as dr
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import Header, Opcode, encode_frame_head
from tensorwire.wire.rpc import SERVICE

ELEMS = 8 << 20  # 32 MiB of float32: eight 4 MiB chunks


def two_generations(c: tensorwire.Client, prefix: str, elems: int) -> torch.Tensor:
    """Publish generation 1 and a generation 2 where every element moved a little (each chunk's
    delta about half its size); returns generation 1."""
    gen = torch.Generator().manual_seed(1)
    first = torch.randn(elems, generator=gen)
    c.publish(prefix, {"w": first})
    c.publish(prefix, {"w": first + 1e-3 * torch.randn(elems, generator=gen)})
    return first


def test_a_delta_answer_counts_against_the_capacity_while_a_reader_that_does_not_read_holds_it() -> None:
    with tensorwire.ServerThread(store=TensorStore(capacity=512 * MiB)) as srv:
        store = srv.server.store
        with tensorwire.connect(srv.url) as c:
            two_generations(c, "d", ELEMS)
        address = Address.parse(srv.url)
        block = dr.encode_request(2, 1, ["d/w"])
        header = Header(1, Opcode.GEN_GET_DELTA, 0, ChecksumKind.XXH3_64, 7, len(block), 0, 0)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # a reader that keeps little
            sock.connect((address.host, address.port))
            sock.sendall(encode_frame_head(header, block))  # and never reads its answer
            wait_for(
                lambda: store.scratch_bytes >= 4 * MiB, 30, "the answer's deltas to be counted while sent"
            )
            assert store.used >= store.kept + store.scratch_bytes
        wait_for(lambda: store.scratch_bytes == 0, 30, "the deltas to be given back once the reader went")


def test_deltas_are_sent_as_full_chunks_where_the_store_has_no_room_for_them() -> None:
    elems = 2 << 20  # 8 MiB: two chunks
    store = TensorStore(capacity=24 * MiB)
    with tensorwire.ServerThread(store=store) as srv, tensorwire.connect(srv.url, retries=0) as c:
        first = two_generations(c, "f", elems)
        c.put(
            "filler",
            torch.zeros(store.capacity - store.used - entry_cost("filler") - 4096, dtype=torch.uint8),
        )
        out = {"f/w": first.clone()}
        got = c.get_many(["f/w"], at=2, base=1, out=out, verify=True)  # bit-exact all the same
        assert torch.equal(got["f/w"], c.get_many(["f/w"], at=2)["f/w"])
        assert c.delta_stats.delta_chunks == 0 and c.delta_stats.full_chunks == 2
        assert srv.server.generation_ops.deltas_full_for_capacity == 2
        c.delete("filler")
        out = {"f/w": first.clone()}
        c.get_many(["f/w"], at=2, base=1, out=out, verify=True)
        assert c.delta_stats.delta_chunks == 2  # with room, deltas again
        wait_for(lambda: store.scratch_bytes == 0, 10, "the deltas to be given back once sent")


def test_a_manifest_counts_against_the_capacity_while_it_is_sent() -> None:
    store = TensorStore(capacity=1 << 20)
    with tensorwire.ServerThread(store=store) as srv, tensorwire.connect(srv.url, retries=0) as c:
        c.publish("m", {f"k{i:03d}": torch.zeros(1) for i in range(100)})  # a manifest of ~5 KiB
        c.put(
            "filler",
            torch.zeros(store.capacity - store.used - entry_cost("filler") - 1024, dtype=torch.uint8),
        )
        with pytest.raises(CapacityExceeded, match="--capacity"):
            c.manifest("m")
        c.delete("filler")
        assert len(c.manifest("m").tensors) == 100
        wait_for(lambda: store.scratch_bytes == 0, 10, "the answer's bytes to be given back once sent")


def test_a_grpc_ranges_answer_counts_against_the_capacity_while_a_reader_does_not_read() -> None:
    store = TensorStore(capacity=256 * MiB)
    with tensorwire.ServerThread(["tcp://127.0.0.1:0", "grpc://127.0.0.1:0"], store=store) as srv:
        with tensorwire.connect(srv.url) as c:
            c.publish("g", {"w": torch.zeros(16 << 20, dtype=torch.uint8)})
        address = srv.addresses[1]

        async def main() -> None:
            async with grpc.aio.insecure_channel(f"{address.host}:{address.port}") as channel:
                ranges = channel.unary_stream(
                    f"/{SERVICE}/GetRanges", pb.RangesRequest.SerializeToString, None
                )
                request = pb.RangesRequest(name="g/w", offsets=[0], lengths=[16 << 20], chunk_bytes=4 << 20)
                call = ranges(request, timeout=30)
                await call.read()  # the first message, then no more reading
                deadline = asyncio.get_running_loop().time() + 20
                while store.scratch_bytes < 4 * MiB:  # the message grpcio holds for it is counted
                    assert asyncio.get_running_loop().time() < deadline, "a held message was not counted"
                    await asyncio.sleep(0.01)
                call.cancel()

        asyncio.run(main())
        wait_for(
            lambda: store.scratch_bytes == 0, 20, "the held message to be given back when the call ended"
        )
