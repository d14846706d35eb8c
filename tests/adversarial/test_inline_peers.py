"""Hostile servers against the blocking client's inline calls (client/inline.py): a peer that
trickles its answer cannot hold a caller's thread past the request's timeout, and one that sends
bytes nobody asked for while the connection is lent cannot make the next call fail on it."""

from __future__ import annotations

import asyncio
import select
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
import torch

import tensorwire
from tensorwire import errors, transport
from tensorwire._aio import LoopThread
from tensorwire.transport.base import ByteStream
from tensorwire.transport.frame_io import FrameReader, read_head, send_frame
from tensorwire.transport.ranged import RangedTransport
from tensorwire.types import Address, Limits, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.frame import Flags, Header, Opcode, decode_header, encode_frame_head
from tensorwire.wire.tensors import byte_view

PAYLOAD = torch.arange(256, dtype=torch.int32)
Answer = Callable[[ByteStream, Header, int], Awaitable[None]]  # stream, request, GETs so far


def _response(req: Header, meta: bytes, data_len: int) -> Header:
    return Header(1, req.opcode, Flags.RESPONSE, req.checksum, req.request_id, len(meta), 4096, data_len)


async def _good_get(stream: ByteStream, req: Header) -> None:
    await stream.send([bytes(await _good_answer(req))])


async def _good_answer(req: Header) -> bytearray:
    """The bytes of a good answer to the GET ``req``, to send as they are or tampered with."""
    meta = wm.encode_records([TensorMeta.of("p", PAYLOAD).with_version(1)])
    frame = bytearray()
    await send_frame(_Collect(frame), _response(req, meta, PAYLOAD.numel() * 4), meta, [byte_view(PAYLOAD)])
    return frame


def _peer(answer_get: Answer) -> Callable[[ByteStream], Awaitable[None]]:
    """A frame-protocol server that answers HELLO and DELETE plainly, and GETs with ``answer_get``
    (told how many GETs it had, over all its connections)."""
    gets = 0

    async def serve(stream: ByteStream) -> None:
        nonlocal gets
        reader = FrameReader(stream)
        while await reader.at_frame_start():
            req = decode_header(await read_head(reader), Limits())
            await reader.read(req.meta_len)
            if req.opcode == Opcode.HELLO:
                meta = wm.encode_hello_response(wm.ServerInfo(1, Limits(), 1 << 30, 0))
                await stream.send([encode_frame_head(_response(req, meta, 0), meta)])
            elif req.opcode == Opcode.DELETE:
                meta = (1).to_bytes(4, "little")
                await stream.send([encode_frame_head(_response(req, meta, 0), meta)])
            else:
                gets += 1
                await answer_get(stream, req, gets)

    return serve


@pytest.fixture
def loop() -> Iterator[LoopThread]:
    thread = LoopThread("hostile-peer")
    yield thread
    thread.stop()


def _listen(loop: LoopThread, answer_get: Answer) -> tuple[str, Callable[[], None]]:
    async def start() -> transport.Listener:
        return await transport.listen(Address.parse("tcp://127.0.0.1:0"), _peer(answer_get))

    listener = loop.call(start(), 10, "the peer to listen")
    return str(listener.address), lambda: loop.call(listener.close(), 10, "the peer to close")


def test_a_trickled_answer_cannot_hold_an_inline_get(loop: LoopThread) -> None:
    """The first GET is answered (through the loop, which then lends the connection); later ones
    a byte every 50 ms: the inline get gives up at its timeout, as the loop's would, and counts as
    the call's first attempt (retries=1: one more GET, through the loop, not two)."""
    gets: list[int] = []

    async def answer(stream: ByteStream, req: Header, count: int) -> None:
        gets.append(count)
        if count == 1:
            await _good_get(stream, req)
            return
        meta = wm.encode_records([TensorMeta.of("p", PAYLOAD).with_version(1)])
        frame = encode_frame_head(_response(req, meta, PAYLOAD.numel() * 4), meta)
        for i in range(len(frame)):
            await stream.send([frame[i : i + 1]])
            await asyncio.sleep(0.05)

    url, close = _listen(loop, answer)
    try:
        with tensorwire.connect(url, timeout=0.5, retries=1, backoff=0.01) as c:
            assert torch.equal(c.get("p"), PAYLOAD)
            t = c._async.current_transport
            assert (
                isinstance(t, RangedTransport) and t._lending.loan is not None
            )  # lent: the next get is inline
            start = time.monotonic()
            with pytest.raises(errors.TransferTimeout, match="get of 'p'"):
                c.get("p")
            assert time.monotonic() - start < 4  # 0.5 s inline, then 0.5 s for the loop's attempt
        assert gets == [1, 2, 3], gets
    finally:
        close()


def test_bytes_sent_unasked_while_lent_drop_the_connection(loop: LoopThread) -> None:
    """After answering, the peer sends junk the client never asked for, while the connection is
    lent: the next call, a delete that is never retried, goes out on a fresh connection."""
    lent = threading.Event()
    sent = threading.Event()

    async def answer(stream: ByteStream, req: Header, gets: int) -> None:
        await _good_get(stream, req)
        if gets == 1:
            await asyncio.get_running_loop().run_in_executor(None, lent.wait, 10)
            await stream.send([b"\x00junk, unasked"])
            sent.set()

    url, close = _listen(loop, answer)
    try:
        with tensorwire.connect(url, timeout=5, retries=0) as c:
            assert torch.equal(c.get("p"), PAYLOAD)
            first = c._async.current_transport
            assert isinstance(first, RangedTransport) and first._lending.loan is not None
            lent.set()
            assert sent.wait(10)
            sock = first._stream._sock  # type: ignore[attr-defined]
            assert select.select([sock], [], [], 10)[0], "the junk never arrived"
            c.delete("p")  # not retried: it must not go out on the connection with the junk
            assert first.closed and c._async.current_transport is not first
    finally:
        close()


def _lent_after_first_get(url: str, **options: object) -> tuple[tensorwire.Client, RangedTransport]:
    """A client whose first get went through the loop, which lent the connection after it: the
    next plain get is read with plain calls (``FrameMux.read_frame_now``)."""
    c = tensorwire.connect(url, **options)  # type: ignore[arg-type]
    assert torch.equal(c.get("p"), PAYLOAD)
    t = c._async.current_transport
    assert isinstance(t, RangedTransport) and t._lending.loan is not None
    return c, t


def _first_good(then: Answer) -> Answer:
    async def answer(stream: ByteStream, req: Header, count: int) -> None:
        if count == 1:
            await _good_get(stream, req)
        else:
            await then(stream, req, count)

    return answer


def test_a_corrupt_chunk_never_reaches_an_inline_gets_out(loop: LoopThread) -> None:
    """The inline get's answer carries a flipped byte under the good chunk's checksum: the get
    fails with CorruptFrame, the caller's ``out`` keeps every byte it had (the chunk is checked in
    the read buffer, before it is copied), and the connection stays in step for the next get."""

    async def corrupt(stream: ByteStream, req: Header, count: int) -> None:
        if count != 2:
            await _good_get(stream, req)
            return
        frame = await _good_answer(req)
        frame[len(frame) - 8 - 3] ^= 0xFF  # a byte of the data, not of its trailer
        await stream.send([bytes(frame)])

    url, close = _listen(loop, _first_good(corrupt))
    try:
        c, t = _lent_after_first_get(url, timeout=5, retries=0)
        with c:
            out = torch.full_like(PAYLOAD, -1)
            with pytest.raises(errors.CorruptFrame):
                c.get("p", out=out)
            assert torch.equal(out, torch.full_like(PAYLOAD, -1)), "a corrupt chunk reached out"
            assert torch.equal(c.get("p", out=out), PAYLOAD) and out.data_ptr() == out.data_ptr()
            assert c._async.current_transport is t and not t.closed
    finally:
        close()


class _Collect(ByteStream):
    """A stream that keeps what is sent to it: the bytes of a frame, to tamper with."""

    peer = "collect"

    def __init__(self, into: bytearray) -> None:
        self._into = into

    async def recv_into(self, buf: memoryview) -> int:
        return 0

    async def send(self, buffers: object) -> None:
        for b in buffers:  # type: ignore[attr-defined]
            self._into += bytes(b)

    async def close(self) -> None:
        pass


def _answer_with(header: Callable[[Header, bytes], Header], meta: bytes) -> Answer:
    async def answer(stream: ByteStream, req: Header, count: int) -> None:
        await stream.send([encode_frame_head(header(req, meta), meta)])

    return answer


def _as_delete(req: Header, meta: bytes) -> Header:
    return Header(1, Opcode.DELETE, Flags.RESPONSE, req.checksum, req.request_id, len(meta), 4096, 0)


def _as_request(req: Header, meta: bytes) -> Header:
    return Header(1, req.opcode, 0, req.checksum, req.request_id, len(meta), 4096, 0)


def _for_the_connection(req: Header, meta: bytes) -> Header:
    return Header(1, 0, Flags.RESPONSE | Flags.ERROR, req.checksum, 0, len(meta), 4096, 0)


def _of_a_gibibyte(req: Header, meta: bytes) -> Header:
    return _response(req, meta, 1 << 30)


_ERROR_META = wm.encode_error(int(errors.ErrorCode.SERVER_ERROR), "everything is on fire")
_GIBIBYTE_META = wm.encode_records([TensorMeta("p", torch.uint8, (1 << 30,), 1 << 30)])


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        pytest.param(
            _answer_with(_as_delete, (1).to_bytes(4, "little")), errors.ProtocolError, id="another-opcode"
        ),
        pytest.param(_answer_with(_as_request, b""), errors.ProtocolError, id="a-request"),
        pytest.param(
            _answer_with(_for_the_connection, _ERROR_META), errors.ServerError, id="connection-error"
        ),
        # Only the header of a 1 GiB answer comes: the coroutines read it, then meet the close.
        pytest.param(_answer_with(_of_a_gibibyte, _GIBIBYTE_META), errors.ConnectionLost, id="not-sent"),
    ],
)
def test_an_inline_answer_out_of_step_drops_the_connection(
    loop: LoopThread, answer: Answer, error: type[errors.TensorwireError]
) -> None:
    """An answer the inline get cannot take (another request's opcode, a request frame, an error
    for the whole connection, a frame that never comes whole) fails the get, by name, at once;
    the connection is dropped and the next call goes out on a fresh one."""

    async def then_close(stream: ByteStream, req: Header, count: int) -> None:
        if count != 2:
            await _good_get(stream, req)
            return
        await answer(stream, req, count)
        await stream.close()

    url, close = _listen(loop, _first_good(then_close))
    try:
        c, t = _lent_after_first_get(url, timeout=5, retries=0)
        with c:
            start = time.monotonic()
            with pytest.raises(error):
                c.get("p")
            assert time.monotonic() - start < 4, "the get waited for its timeout"
            assert torch.equal(c.get("p"), PAYLOAD)
            assert t.closed and c._async.current_transport is not t
    finally:
        close()


def test_a_stale_answer_before_an_inline_gets_own_is_skipped(loop: LoopThread) -> None:
    """A late answer to a request nobody waits for (another id) comes first: the inline get skips
    it, data and all, and takes its own."""

    async def stale_first(stream: ByteStream, req: Header, count: int) -> None:
        if count == 2:
            meta = wm.encode_records([TensorMeta.of("p", PAYLOAD).with_version(1)])
            rid, size = req.request_id + 1000, PAYLOAD.numel() * 4
            stale = Header(1, req.opcode, Flags.RESPONSE, req.checksum, rid, len(meta), 4096, size)
            await send_frame(stream, stale, meta, [byte_view(PAYLOAD)])
        await _good_get(stream, req)

    url, close = _listen(loop, _first_good(stale_first))
    try:
        c, t = _lent_after_first_get(url, timeout=5, retries=0)
        with c:
            assert torch.equal(c.get("p"), PAYLOAD)
            assert c._async.current_transport is t and not t.closed
    finally:
        close()


def test_bytes_unasked_behind_an_inline_answer_drop_the_connection(loop: LoopThread) -> None:
    """The peer sends junk in the same write as an inline get's answer, so the get reads it into
    its buffer along with the answer: the get succeeds, and the next call, a delete that is never
    retried, goes out on a fresh connection (not on one whose next "answer" is the junk)."""

    async def junk_behind(stream: ByteStream, req: Header, count: int) -> None:
        if count != 2:
            await _good_get(stream, req)
            return
        await stream.send([bytes(await _good_answer(req)) + b"\x00junk, unasked"])

    url, close = _listen(loop, _first_good(junk_behind))
    try:
        c, t = _lent_after_first_get(url, timeout=5, retries=0)
        with c:
            assert torch.equal(c.get("p"), PAYLOAD)  # inline, the junk read with it
            assert t._mux._reader.buffered  # the junk, read behind the answer
            c.delete("p")  # not retried: it must not go out on the connection with the junk
            assert t.closed and c._async.current_transport is not t
    finally:
        close()
