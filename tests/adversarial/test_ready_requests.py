"""Small requests served from the loop's readiness callback (``Session._ready``): a peer sees the
same answers, in the same order, with the same limits, as from the session's task, whatever it
sends in one write and however slowly it reads; the callback never serves what the server's
table no longer holds, and never keeps the loop from its other connections."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import torch

import tensorwire
from tensorwire import Server
from tensorwire._aio import hold_now, run, within
from tensorwire.errors import ErrorCode
from tensorwire.server.options import ConnectionOptions, ServerOptions
from tensorwire.store import TensorStore
from tensorwire.testing.conformance.frames import put_frame, raw, read_reply
from tensorwire.transport.frame_io import FrameReader, recv_data
from tensorwire.transport.tcp import TcpStream
from tensorwire.transport.whole import TRAILER
from tensorwire.types import GiB, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.frame import Header, Opcode, encode_frame_head

DEADLINE = 20.0
STALL = 0.5


def _get(names: list[str], rid: int, op: Opcode = Opcode.GET) -> bytes:
    meta = wm.encode_names(names)
    return encode_frame_head(Header(1, op, 0, ChecksumKind.XXH3_64, rid, len(meta), 0, 0), meta)


def _put(name: str, data: bytes, rid: int, *, record_bytes: int = 0, records: int = 1) -> bytes:
    """A PUT of one chunk (its record may say ``record_bytes`` instead, or come ``records`` times)."""
    size = record_bytes or len(data)
    block = wm.encode_records(
        [TensorMeta(f"{name}{i or ''}", torch.uint8, (size,), size) for i in range(records)]
    )
    header = Header(1, Opcode.PUT, 0, ChecksumKind.XXH3_64, rid, len(block), 64 << 10, len(data))
    return encode_frame_head(header, block) + data + TRAILER.pack(checksum(ChecksumKind.XXH3_64, data))


async def _answer(reader: FrameReader) -> tuple[Header, object]:
    """One answer: (header, error code) for an error, else (header, its data bytes)."""
    header, meta = await read_reply(reader)
    if header.is_error:
        return header, wm.decode_error(meta)[0]
    data = bytearray(header.data_len)
    await recv_data(reader, header, [memoryview(data)])
    return header, bytes(data)


def test_pipelined_gets_are_answered_in_order_across_the_callback_and_the_task() -> None:
    """One write carries 100 GETs (more than one callback serves), a GET of a missing tensor, a
    GET naming two tensors and a frame whose metadata checksum fails. The answers come in order,
    each with its request id and the stored bytes; the two refusals keep the connection; the
    corrupt frame gets its error from the task, which then hangs up."""

    async def main() -> None:
        srv = Server(store=TensorStore(GiB))
        await srv.start("tcp://127.0.0.1:0")
        try:
            async with raw(srv) as (stream, reader):
                data = bytes(range(256)) * 4
                await stream.send([put_frame([TensorMeta("t", torch.uint8, (1024,), 1024)], data, rid=1)])
                assert not (await read_reply(reader))[0].is_error  # the first frame admits the session
                corrupt = bytearray(_get(["t"], 104))
                corrupt[-1] ^= 0xFF
                frames = [_get(["t"], 2 + i) for i in range(100)]
                frames += [_get(["missing"], 102), _get(["t", "t2"], 103), bytes(corrupt)]
                await stream.send([b"".join(frames)])
                for i in range(100):
                    header, got = await within(_answer(reader), DEADLINE)
                    assert (header.request_id, got) == (2 + i, data)
                answers = [await within(_answer(reader), DEADLINE) for _ in range(3)]
                assert [(h.request_id, code) for h, code in answers] == [
                    (102, ErrorCode.KEY_NOT_FOUND),
                    (103, ErrorCode.PROTOCOL_ERROR),
                    (104, ErrorCode.CORRUPT_FRAME),
                ]
                assert await within(reader.at_frame_start(), DEADLINE) is False  # then it hung up
        finally:
            await srv.close()

    run(main())


def test_pipelined_puts_are_checked_in_the_read_buffer_before_anything_is_stored() -> None:
    """One write carries small PUTs: a good one, one whose chunk fails its checksum, one whose
    record says another size, one with two records, one over the store's capacity, then a GET.
    Each is answered in order from the callback; only the good put is stored, the store counts no
    byte of the others, and the GET reads the good bytes."""

    async def main() -> None:
        store = TensorStore(64 << 10)
        srv = Server(store=store)
        await srv.start("tcp://127.0.0.1:0")
        try:
            async with raw(srv) as (stream, reader):
                await stream.send([_get(["nothing"], 1)])  # the first frame admits the session
                assert (await read_reply(reader))[0].is_error
                good = bytes(range(256)) * 4
                corrupt = bytearray(_put("b", good, 3))
                corrupt[-9] ^= 0xFF  # the chunk's last byte: its trailer no longer matches
                frames = [
                    _put("a", good, 2),
                    bytes(corrupt),
                    _put("c", good, 4, record_bytes=512),
                    _put("d", good, 5, records=2),
                    _put("e", bytes(63 << 10), 6),  # room for it alone, but not beside "a"
                    _get(["a"], 7),
                ]
                await stream.send([b"".join(frames)])
                answers = [await within(_answer(reader), DEADLINE) for _ in range(6)]
                assert [h.request_id for h, _ in answers] == [2, 3, 4, 5, 6, 7]
                assert not answers[0][0].is_error
                assert [code for _, code in answers[1:5]] == [
                    ErrorCode.CORRUPT_FRAME,
                    ErrorCode.INVALID_TENSOR,
                    ErrorCode.PROTOCOL_ERROR,
                    ErrorCode.CAPACITY_EXCEEDED,
                ]
                assert answers[5][1] == good
                assert [m.name for m in store.list()] == ["a"]
                assert store.reserved == 0 and store.stored == len(good)
        finally:
            await srv.close()

    run(main())


def test_an_opcode_taken_out_of_the_table_is_not_served_by_the_callback() -> None:
    """A listener that serves only some opcodes (a relay's, ``serve_only``) takes GET out of the
    server's one table: the callback looks there too, so a GET is refused, not answered."""

    async def main() -> None:
        srv = Server(store=TensorStore(GiB))
        await srv.start("tcp://127.0.0.1:0")
        try:
            async with raw(srv) as (stream, reader):
                await stream.send([put_frame([TensorMeta("t", torch.uint8, (4,), 4)], b"abcd", rid=1)])
                assert not (await read_reply(reader))[0].is_error
                del srv.handlers[Opcode.GET]
                await stream.send([_get(["t"], 2)])
                header, code = await within(_answer(reader), DEADLINE)
                assert (header.request_id, code) == (2, ErrorCode.PROTOCOL_ERROR)
        finally:
            await srv.close()

    run(main())


def test_a_peer_that_stops_reading_is_cut_off_and_the_others_are_served_meanwhile() -> None:
    """A peer sends GETs of a 15 KiB tensor and reads none of the answers: once its socket is
    full, an answer goes out in part from the callback, the rest waits in the task under the stall
    timeout, and the connection is closed. Another client is served all along."""

    async def main() -> None:
        srv = Server(
            ServerOptions(connections=ConnectionOptions(stall_timeout=STALL)), store=TensorStore(GiB)
        )
        [address] = await srv.start("tcp://127.0.0.1:0")
        client = await tensorwire.aconnect(str(address))
        try:
            await client.put("big", torch.zeros(15 << 10, dtype=torch.uint8))
            with _peer(address.host, address.port) as sock:
                await _fill(srv, sock)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + DEADLINE
                while srv.status()["connections"] > 1:  # the peer's session is cut; the client's stays
                    assert loop.time() < deadline, "a peer that reads nothing kept its session"
                    assert await within(client.get("big"), 5.0) is not None
                    await asyncio.sleep(0.05)
            assert torch.equal(await client.get("big"), torch.zeros(15 << 10, dtype=torch.uint8))
        finally:
            await client.close()
            await srv.close()

    run(main())


def test_a_peer_that_reads_late_gets_every_answer_whole_and_in_order() -> None:
    """GETs answered from the callback until the peer's socket is full; the answer that fits only
    in part is finished by the task, and ten more GETs wait behind it. A peer that starts reading
    only then gets each answer whole, in order."""

    async def main() -> None:
        srv = Server(store=TensorStore(GiB))
        [address] = await srv.start("tcp://127.0.0.1:0")
        data = bytes(range(256)) * 60  # 15 KiB: a small answer, one frame
        try:
            client = await tensorwire.aconnect(str(address))
            try:
                await client.put("big", torch.frombuffer(bytearray(data), dtype=torch.uint8))
            finally:
                await client.close()
            with _peer(address.host, address.port) as sock:
                sent = await _fill(srv, sock)
                loop = asyncio.get_running_loop()
                await loop.sock_sendall(sock, b"".join(_get(["big"], 2 + sent + i) for i in range(10)))
                late = FrameReader(TcpStream(sock))
                for i in range(sent + 10):
                    header, got = await within(_answer(late), DEADLINE)
                    assert (header.request_id, got) == (2 + i, data)
        finally:
            await srv.close()

    run(main())


@contextlib.contextmanager
def _peer(host: str, port: int) -> Iterator[socket.socket]:
    sock = socket.create_connection((host, port))
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # past loopback's MSS
        sock.setblocking(False)
        yield sock
    finally:
        sock.close()


async def _fill(srv: Server, sock: socket.socket) -> int:
    """GETs of "big" sent one at a time, each once the one before was answered, until an answer
    goes out only in part from the readiness callback (the peer reads nothing): how many."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    base = _gets(srv)
    for sent in range(1, 10_000):
        await loop.sock_sendall(sock, _get(["big"], 1 + sent))
        while _gets(srv) < base + sent:
            assert loop.time() < deadline, f"GET {sent} was not answered"
            await asyncio.sleep(0.001)
        if any(session.unsent is not None for session in srv._sessions):  # the path under test
            return sent
    raise AssertionError("10,000 answers went out whole to a peer that reads none")


def _gets(srv: Server) -> int:
    row = srv.counts.rows.get(("get", "tcp"))
    return row.requests if row is not None else 0


def test_the_write_lock_is_taken_now_or_not_at_all() -> None:
    """``hold_now``: a free lock is taken; a held one, or a free one another task waits for
    (its turn comes first), is not, and that task's place in the queue is kept."""

    async def main() -> None:
        lock = asyncio.Lock()
        assert hold_now(lock) and lock.locked()
        assert not hold_now(lock)
        waiter = asyncio.ensure_future(lock.acquire())
        await asyncio.sleep(0)
        lock.release()  # free, but the waiter's turn
        assert not hold_now(lock)
        assert await within(waiter, DEADLINE) is True and lock.locked()
        lock.release()

    run(main())
