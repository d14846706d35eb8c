"""Item 15: one request's data, checksums and disk work never stall the loop that serves others.

A 1 GiB put froze every other connection for 1.4-2 s (a socket that keeps up never made the
reader wait), and a DELETE during another client's persisted commit blocked the event loop until
the commit's disk write was done. The figure (a 1 KiB ping during a 1 GiB put) is measured by
``tensorwire bench transfer`` (``ping_during_put_p99_ms``); here the mechanisms are checked
deterministically: frames over a stream that never makes its reader or writer wait still give the
loop turns, and a PING is answered while a persisted commit is held inside its disk write.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import tensorwire
from tensorwire._aio import run
from tensorwire.errors import TransferTimeout
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.store.persist import DataDir
from tensorwire.testing.process import run_threads, wait_for
from tensorwire.transport.base import Buffer, ByteStream
from tensorwire.transport.frame_io import FrameReader, read_head, recv_data, send_frame
from tensorwire.types import Limits, MiB
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import Header, Opcode, decode_header

SIZE = 64 * MiB
CHUNK = 4 * MiB


class Eager(ByteStream):
    """A stream that always has room and always has bytes: it never makes anyone wait (a fast
    peer on a fast link, at its limit)."""

    peer = "eager://"

    def __init__(self) -> None:
        self.wire = bytearray()
        self.pos = 0

    async def recv_into(self, buf: memoryview) -> int:
        n = min(buf.nbytes, len(self.wire) - self.pos)
        buf[:n] = self.wire[self.pos : self.pos + n]
        self.pos += n
        return n

    async def send(self, buffers: Sequence[Buffer]) -> None:
        for b in buffers:
            self.wire += b

    async def close(self) -> None:
        pass


async def turns_during(work: asyncio.Future[None] | asyncio.Task[None]) -> int:
    """How many turns another task got while ``work`` ran."""
    turns = 0
    while not work.done():
        turns += 1
        await asyncio.sleep(0)
    await work
    return turns


async def a_big_frame_over_an_eager_stream() -> tuple[int, int]:
    stream = Eager()
    data = memoryview(torch.ones(SIZE // 4).numpy()).cast("B")
    header = Header(1, Opcode.PUT, 0, ChecksumKind.XXH3_64, 1, 0, CHUNK, SIZE)
    sending = asyncio.ensure_future(send_frame(stream, header, b"", [data]))
    sent_turns = await turns_during(sending)
    reader = FrameReader(stream)
    got = decode_header(await read_head(reader), Limits())
    dest = memoryview(bytearray(SIZE))
    receiving = asyncio.ensure_future(recv_data(reader, got, [dest]))
    received_turns = await turns_during(receiving)
    assert dest == data
    return sent_turns, received_turns


def test_a_big_frame_gives_the_loop_turns_though_its_stream_never_waits() -> None:
    sent, received = run(a_big_frame_over_an_eager_stream())
    # 64 MiB at several GB/s takes tens of milliseconds: a turn every ~1 ms is at least a few.
    assert sent >= 2, f"sending 64 MiB gave the loop {sent} turns"
    assert received >= 2, f"receiving 64 MiB gave the loop {received} turns"


def test_ping_and_delete_go_on_while_a_persisted_commit_is_held_in_its_disk_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writing, release = threading.Event(), threading.Event()
    real_write = DataDir.write

    def held_write(self: DataDir, items: object) -> None:
        writing.set()
        assert release.wait(30), "the test never released the disk write"
        real_write(self, items)  # type: ignore[arg-type]

    with ServerThread(store=TensorStore(64 * MiB, tmp_path)) as srv:
        with tensorwire.connect(srv.url) as c:
            c.put("old", torch.ones(4))
        monkeypatch.setattr(DataDir, "write", held_write)
        counts = srv.server.counts

        def client(i: int) -> None:
            with tensorwire.connect(srv.url, timeout=30) as mine:
                if i == 0:
                    mine.put("new", torch.ones(1024))  # its commit is held inside the disk write
                else:
                    assert writing.wait(10)
                    mine.delete("old")  # waits for the disk, not on the loop

        workers = threading.Thread(target=run_threads, args=(client, 2, 60), daemon=True)
        workers.start()
        try:
            wait_for(lambda: writing.is_set() and counts.in_flight >= 2, 10, "the commit and the delete")
            try:
                with tensorwire.connect(srv.url, timeout=5, retries=0) as other:
                    other.ping()  # the loop answers while the disk is busy
                    assert other.stat("old").name == "old"  # the delete has not run yet
            except TransferTimeout as exc:
                raise AssertionError("the event loop was blocked while a commit held the disk") from exc
        finally:
            release.set()
            workers.join(30)
        with tensorwire.connect(srv.url) as c:
            assert [m.name for m in c.list()] == ["new"]
