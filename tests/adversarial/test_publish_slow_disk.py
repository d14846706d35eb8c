"""A publish on a ``--data-dir`` server waits on the server's own disk, not on its peer (issue 32,
review 2 #3): a durable write longer than ``--stall-timeout`` (a large checkpoint on a slow volume,
or publishes queued behind another's write) must not get the publisher's connection cut by the
stall watchdog while its generation is published anyway (the publisher would hear "connection
lost", publish again, and make a duplicate). And the watchdog closes a stalled connection once:
a handler still finishing after the close is not closed (and logged) again at every tick."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from psid_kit import call

import tensorwire
from tensorwire._aio import LoopThread
from tensorwire.errors import ConnectionLost
from tensorwire.server.core import Server
from tensorwire.server.options import ConnectionOptions, ServerOptions
from tensorwire.server.request import Handler, Request
from tensorwire.store import TensorStore, generation_disk
from tensorwire.wire.frame import Opcode

STALL = 0.3  # seconds: the watchdog ticks every STALL / 4


@contextmanager
def serving(server: Server) -> Iterator[str]:
    loop = LoopThread("slow-disk-server")
    try:
        url = str(loop.submit(server.start("tcp://127.0.0.1:0")).result(10)[0])
        yield url
    finally:
        loop.submit(server.close()).result(10)
        loop.stop()


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Each generation's write takes 4 stall timeouts (a slow volume); the event is set once one
    has begun."""
    began = threading.Event()
    write = generation_disk.GenerationDisk.write

    def slow(self: generation_disk.GenerationDisk, *args: Any) -> None:
        began.set()
        time.sleep(4 * STALL)  # the disk is slow: this is its speed, not a synchronisation
        write(self, *args)

    monkeypatch.setattr(generation_disk.GenerationDisk, "write", slow)
    return began


def test_a_publish_behind_a_slow_disk_is_answered_not_cut_off(
    tmp_path: Path, slow_disk: threading.Event
) -> None:
    server = Server(
        ServerOptions(connections=ConnectionOptions(stall_timeout=STALL)),
        store=TensorStore(capacity=64 << 20, data_dir=tmp_path),
    )
    with serving(server) as url, tensorwire.connect(url, retries=0) as c:
        gen = c.publish("m", {"w": torch.arange(4.0)})  # before: ConnectionLost, and generation 1 there
        assert gen.number == 1 and slow_disk.is_set()
        assert c.manifest("m").generation.number == 1
        # Two publishes queued behind one another's write (one durable write at a time): both answered.
        with tensorwire.connect(url, retries=0) as other:
            done: list[int] = []
            publish_n = lambda: done.append(other.publish("n", {"w": torch.ones(2)}).number)  # noqa: E731
            second = threading.Thread(target=publish_n)
            second.start()
            assert c.publish("m", {"w": torch.zeros(4)}).number == 2
            second.join(30)
            assert done == [1]


class _Slow:
    """An extension whose one handler works on the server's side for a while, outside
    ``Request.waiting``: the watchdog cuts its connection, and the handler finishes later."""

    def __init__(self) -> None:
        self.finished = threading.Event()

    def frame_handlers(self) -> Mapping[int, Handler]:
        return {Opcode.PS_STATS: self.stats}

    def rpc_handlers(self) -> Sequence[Any]:
        return ()

    async def close(self) -> None:
        return None

    async def stats(self, req: Request) -> None:
        await asyncio.sleep(10 * STALL)
        self.finished.set()
        await req.reply(b"")


def test_the_watchdog_closes_a_stalled_connection_once(caplog: pytest.LogCaptureFixture) -> None:
    slow = _Slow()
    server = Server(ServerOptions(connections=ConnectionOptions(stall_timeout=STALL)), extensions=[slow])
    caplog.set_level(logging.WARNING, logger="tensorwire.server")
    with serving(server) as url:
        with pytest.raises(ConnectionLost):
            call(url, Opcode.PS_STATS, b"")
        assert slow.finished.wait(30)  # the handler went on for 10 stall timeouts after the close
    closes = [r for r in caplog.records if "no progress" in r.getMessage()]
    assert len(closes) == 1, [r.getMessage() for r in closes]  # before: one per watchdog tick
