"""The gRPC generation calls (docs/protocol.md §14.9) hold a peer to the same bounds as their
frames: PublishPart (GEN_PUBLISH_PART) and GetRanges (GEN_GET_RANGES), spoken here by a raw
``grpc.aio`` peer, not the tensorwire client.

A GetRanges over the count limit, with offsets and lengths that disagree, past the answer limit or
outside its tensor is refused before a byte streams; a part without a token is refused before it
is read; a part whose first chunk names no transaction, or a transaction over the server's bounds,
reserves nothing; a part whose chunk fails its checksum aborts its transaction with nothing kept;
and a part whose call is cancelled midway aborts its transaction for the other parts at once and
frees its bytes (the frame side's closed connection). Each test fails with its check removed from
server/rpc_generations.py or wire/rpc.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
import torch

import tensorwire
from tensorwire.errors import LimitExceeded, PublishAborted
from tensorwire.server import Server
from tensorwire.server.options import ConnectionOptions, ServerOptions
from tensorwire.store import TensorStore
from tensorwire.store.generations import GenerationConfig
from tensorwire.testing.process import wait_for
from tensorwire.types import TensorMeta
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.wire import generations as wg
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.rpc import SERVICE, encode_chunk, info_of, part_info

TOKEN = "grpc-parts"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture
def srv() -> Iterator[tensorwire.ServerThread]:
    config = GenerationConfig(max_parts=4, max_transactions=2, max_wait_seconds=10.0)
    limits = tensorwire.Limits(max_request_bytes=1 << 20)
    with tensorwire.ServerThread(
        ["grpc://127.0.0.1:0"], ServerOptions(token=TOKEN, generations=config, limits=limits)
    ) as server:
        yield server


def _target(srv: tensorwire.ServerThread) -> str:
    address = srv.addresses[0]
    return f"{address.host}:{address.port}"


def _run(main: Any) -> None:
    asyncio.run(asyncio.wait_for(main, 30))


def _idle(srv: tensorwire.ServerThread) -> None:
    parts = srv.server.generation_ops.parts
    store = srv.server.store
    wait_for(lambda: not parts.open and store.reserved == 0, 10, "every part's bytes to be freed")


def _published(srv: tensorwire.ServerThread, tensors: dict[str, torch.Tensor]) -> None:
    with tensorwire.connect(srv.url, token=TOKEN) as client:
        client.publish_part("g", tensors, txn=os.urandom(16), index=0, count=1, timeout=5)


async def _status(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    raise AssertionError("the call succeeded")


async def _drain(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    raise AssertionError("the stream succeeded")


# -- GetRanges -------------------------------------------------------------------------------------
def test_a_ranges_request_over_the_count_limit_or_lopsided_is_refused(srv: tensorwire.ServerThread) -> None:
    _published(srv, {"w": torch.zeros(16)})

    async def main() -> None:
        async with grpc.aio.insecure_channel(_target(srv)) as channel:
            ranges = channel.unary_stream(f"/{SERVICE}/GetRanges", pb.RangesRequest.SerializeToString, None)
            many = wg.MAX_RANGES + 1  # empty ranges: without the count check they would be served
            request = pb.RangesRequest(name="g/w", offsets=[0] * many, lengths=[0] * many)
            code, details = await _drain(ranges(request, metadata=AUTH, timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and f"1 to {wg.MAX_RANGES}" in details
            lopsided = pb.RangesRequest(name="g/w", offsets=[0, 4], lengths=[4])
            code, details = await _drain(ranges(lopsided, metadata=AUTH, timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "2 offsets and 1 lengths" in details

    _run(main())


def test_a_ranges_request_past_the_answer_limit_or_its_tensor_is_refused(
    srv: tensorwire.ServerThread,
) -> None:
    _published(srv, {"w": torch.zeros(1 << 18)})  # 1 MiB: the server's max_request_bytes

    async def main() -> None:
        async with grpc.aio.insecure_channel(_target(srv)) as channel:
            ranges = channel.unary_stream(f"/{SERVICE}/GetRanges", pb.RangesRequest.SerializeToString, None)
            twice = pb.RangesRequest(name="g/w", offsets=[0, 0], lengths=[1 << 20, 1 << 20])
            code, details = await _drain(ranges(twice, metadata=AUTH, timeout=10))
            assert code == grpc.StatusCode.OUT_OF_RANGE and "exceeds" in details
            outside = pb.RangesRequest(name="g/w", offsets=[0, (1 << 20) - 4], lengths=[4, 8])
            code, details = await _drain(ranges(outside, metadata=AUTH, timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "not inside" in details
        kept = srv.server.generations.find("g", 0)
        assert kept.pins == 0  # the refusals unpinned what they had pinned

    _run(main())


# -- PublishPart -----------------------------------------------------------------------------------
def _chunks(head: wg.PartHead | None, meta: TensorMeta, data: bytes, *, cut: int = 1 << 16,
            corrupt: bool = False) -> list[bytes]:  # fmt: skip
    """The raw Chunk messages of a part of one tensor."""
    out = []
    for start in range(0, len(data), cut):
        piece = data[start : start + cut]
        sum_ = checksum(ChecksumKind.XXH3_64, piece) ^ (1 if corrupt and start else 0)
        first = start == 0
        out.append(encode_chunk(piece, ChecksumKind.XXH3_64, sum_, info_of(meta) if first else None,
                                part_info(head) if first and head is not None else None))  # fmt: skip
    return out


async def _stream(messages: list[bytes], hold: asyncio.Event | None = None) -> AsyncIterator[bytes]:
    for i, raw in enumerate(messages):
        if hold is not None and i == len(messages) // 2:
            await hold.wait()  # stop halfway: the call is cancelled meanwhile
        yield raw


def _part_call(channel: grpc.aio.Channel) -> Any:
    return channel.stream_unary(f"/{SERVICE}/PublishPart", None, pb.GenerationInfo.FromString)


def _meta(name: str, nbytes: int) -> TensorMeta:
    return TensorMeta(name, torch.uint8, (nbytes,), nbytes)


def test_a_part_without_a_token_is_refused_before_it_is_read(srv: tensorwire.ServerThread) -> None:
    async def main() -> None:
        head = wg.PartHead("p", os.urandom(16), 0, 2, 5000)
        async with grpc.aio.insecure_channel(_target(srv)) as channel:
            messages = _chunks(head, _meta("p/t", 1 << 19), bytes(1 << 19))
            # Only the first message is sent, then the stream waits: a server that read on before
            # refusing would wait for the rest and the call would end in its deadline. (Sending
            # it all raced the refusal: a client still writing when the server ends the stream
            # may see gRPC's INTERNAL for the reset instead of the server's status.)
            rest = asyncio.Event()
            call = _part_call(channel)(_stream(messages[:2], hold=rest), timeout=10)
            code, _ = await _status(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED
        assert not srv.server.generation_ops.parts.open  # no transaction was opened

    _run(main())
    _idle(srv)


def test_a_part_that_names_no_transaction_or_too_many_reserves_nothing(srv: tensorwire.ServerThread) -> None:
    async def main() -> None:
        async with grpc.aio.insecure_channel(_target(srv)) as channel:
            call = _part_call(channel)
            headless = _chunks(None, _meta("p/t", 4096), bytes(4096))
            code, details = await _status(call(_stream(headless), metadata=AUTH, timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "no part head" in details
            short_id = wg.PartHead("p", os.urandom(8), 0, 2, 5000)
            code, details = await _status(call(_stream(_chunks(short_id, _meta("p/t", 8), bytes(8))),
                                               metadata=AUTH, timeout=10))  # fmt: skip
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "16 bytes, not 8" in details
            too_many = wg.PartHead("p", os.urandom(16), 0, 5, 5000)
            code, details = await _status(call(_stream(_chunks(too_many, _meta("p/t", 8), bytes(8))),
                                               metadata=AUTH, timeout=10))  # fmt: skip
            assert code == grpc.StatusCode.OUT_OF_RANGE and "at most 4" in details
            assert srv.server.store.reserved == 0

    _run(main())
    _idle(srv)


def test_open_transactions_are_bounded_server_wide_over_grpc(srv: tensorwire.ServerThread) -> None:
    async def main() -> None:
        async with await tensorwire.aconnect(srv.url, token=TOKEN) as client:
            held = [
                asyncio.ensure_future(client.publish_part(
                    "p", {f"t{i}": torch.zeros(4)}, txn=os.urandom(16), index=0, count=2, timeout=5))
                for i in range(2)
            ]  # fmt: skip
            parts = srv.server.generation_ops.parts
            while len(parts.open) < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(LimitExceeded, match="this server has open 2 multi-part publishes"):
                await client.publish_part("p", {"t": torch.zeros(4)}, txn=os.urandom(16), index=0,
                                          count=2, timeout=5)  # fmt: skip
            for future in held:
                future.cancel()

    _run(main())
    _idle(srv)


def test_a_part_with_a_corrupt_chunk_aborts_its_transaction_and_keeps_nothing(
    srv: tensorwire.ServerThread,
) -> None:
    async def main() -> None:
        txn = os.urandom(16)
        async with (
            await tensorwire.aconnect(srv.url, token=TOKEN) as client,
            grpc.aio.insecure_channel(_target(srv)) as channel,
        ):
            other = asyncio.ensure_future(
                client.publish_part("p", {"a": torch.zeros(4)}, txn=txn, index=0, count=2, timeout=5)
            )
            bad = _chunks(
                wg.PartHead("p", txn, 1, 2, 5000), _meta("p/b", 1 << 18), bytes(1 << 18), corrupt=True
            )
            code, details = await _status(_part_call(channel)(_stream(bad), metadata=AUTH, timeout=10))
            assert code == grpc.StatusCode.ABORTED and "part 1 failed" in details and "checksum" in details
            with pytest.raises(PublishAborted, match="part 1 failed"):
                await other
        assert srv.server.generations.latest("p") is None

    _run(main())
    _idle(srv)


def test_a_part_whose_call_is_cancelled_midway_aborts_its_transaction_and_frees_its_bytes(
    srv: tensorwire.ServerThread,
) -> None:
    async def main() -> None:
        txn = os.urandom(16)
        store = srv.server.store
        async with (
            await tensorwire.aconnect(srv.url, token=TOKEN) as client,
            grpc.aio.insecure_channel(_target(srv)) as channel,
        ):
            other = asyncio.ensure_future(
                client.publish_part("p", {"a": torch.zeros(4)}, txn=txn, index=0, count=2, timeout=8)
            )
            hold = asyncio.Event()  # never set: the part stops halfway
            messages = _chunks(wg.PartHead("p", txn, 1, 2, 8000), _meta("p/b", 1 << 19), bytes(1 << 19))
            call = _part_call(channel)(_stream(messages, hold), metadata=AUTH, timeout=20)
            while store.reserved < (1 << 19):  # the part's bytes are reserved: it is midway
                await asyncio.sleep(0.01)
            call.cancel()
            # At once, not at the transaction's 8 s timeout (that would be WaitTimeout): grpcio
            # either cancels the handler (the call closed) or ends its stream (the part is short).
            aborted = r"aborted: (the call that sent its part 1 closed|part 1 failed.*ended after \d+ of its)"
            with pytest.raises(PublishAborted, match=aborted):
                await asyncio.wait_for(other, 4)
        assert srv.server.generations.latest("p") is None

    _run(main())
    _idle(srv)


def test_a_part_whose_call_is_cancelled_while_it_waits_for_the_others_aborts_its_transaction(
    srv: tensorwire.ServerThread,
) -> None:
    async def main() -> None:
        txn = os.urandom(16)
        parts = srv.server.generation_ops.parts
        async with (
            await tensorwire.aconnect(srv.url, token=TOKEN) as client,
            grpc.aio.insecure_channel(_target(srv)) as channel,
        ):
            other = asyncio.ensure_future(
                client.publish_part("p", {"a": torch.zeros(4)}, txn=txn, index=0, count=3, timeout=8)
            )
            messages = _chunks(wg.PartHead("p", txn, 1, 3, 8000), _meta("p/b", 1 << 18), bytes(1 << 18))
            call = _part_call(channel)(_stream(messages), metadata=AUTH, timeout=20)
            while not parts.open or len(next(iter(parts.open.values())).parts) < 2:
                await asyncio.sleep(0.01)  # both parts are in, parked: part 2 never comes
            call.cancel()
            with pytest.raises(
                PublishAborted, match="the call that sent its part 1 closed before the commit"
            ):
                await asyncio.wait_for(other, 4)
        assert srv.server.generations.latest("p") is None

    _run(main())
    _idle(srv)


# -- Lease -----------------------------------------------------------------------------------------
def test_leases_outlive_their_connection_so_the_peers_holding_one_are_bounded() -> None:
    """A gRPC lease belongs to its peer (one HTTP/2 connection) and runs out at its time, not when
    the connection closes: a client that reconnects between leases would otherwise hold
    ``leases_per_owner`` more each time. The peers holding one are bounded by the connection limit."""

    async def lease_from_a_new_connection(target: str) -> tuple[grpc.StatusCode | None, str]:
        # A subchannel of its own: grpcio shares one connection between channels to a target
        # otherwise, and each lease must come from a new peer.
        local = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(target, options=local) as channel:
            lease = channel.unary_unary(f"/{SERVICE}/Lease", pb.LeaseRequest.SerializeToString,
                                        pb.LeaseReply.FromString)  # fmt: skip
            try:
                reply = await lease(pb.LeaseRequest(prefix="g", number=1, milliseconds=30_000), timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code(), exc.details() or ""
            assert reply.granted_ms > 0
            return None, ""

    async def lease_once_there_is_room(target: str) -> tuple[grpc.StatusCode | None, str]:
        """grpcio's own bound on connections (2 here) closes a new one at once while the server has
        not yet seen a closed one go (UNAVAILABLE, "Socket closed"): ask again until it has."""
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            code, details = await lease_from_a_new_connection(target)
            if code != grpc.StatusCode.UNAVAILABLE or asyncio.get_running_loop().time() > deadline:
                return code, details
            await asyncio.sleep(0.05)

    async def main() -> None:
        server = Server(
            ServerOptions(connections=ConnectionOptions(max_connections=2)), store=TensorStore(1 << 20)
        )
        await server.start("grpc://127.0.0.1:0")
        try:
            address = server.addresses[0]
            async with await tensorwire.aconnect(str(address)) as client:
                await client.publish_part("g", {"w": torch.zeros(4)}, txn=os.urandom(16), index=0,
                                          count=1, timeout=5)  # fmt: skip
            target = f"{address.host}:{address.port}"
            assert await lease_once_there_is_room(target) == (None, "")
            assert await lease_once_there_is_room(target) == (None, "")
            code, details = await lease_once_there_is_room(target)
            assert code == grpc.StatusCode.OUT_OF_RANGE and "at most 2 (--max-connections)" in details
        finally:
            await server.close()

    _run(main())
