"""GEN_PUBLISH_PART (docs/protocol.md §14.8): every piece of state a peer makes the server hold for
a multi-part publish is bounded, and every way a transaction can fail frees all of it.

Parts per transaction, open transactions server-wide and per connection, the timeout a part may
ask for; parts whose names collide; a transaction left incomplete is freed at its timeout; a
connection that closes with a part in a transaction aborts it for every other part at once; a part
arriving after its transaction was aborted is refused with the same error. And GEN_GET_RANGES, the
batched ranged read: ranges inside the tensor, their count and their total bytes bounded. Each test fails with
its check removed from server/generation_parts.py (a bound: the part is taken and waits out its
timeout instead of being refused).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest
import torch

import tensorwire
from tensorwire.errors import InvalidTensor, LimitExceeded, ProtocolError, PublishAborted, WaitTimeout
from tensorwire.server.options import ServerOptions
from tensorwire.store.generations import GenerationConfig
from tensorwire.testing.process import wait_for
from tensorwire.transport import TransportOptions, open_channel
from tensorwire.types import Limits
from tensorwire.wire import generations as wg
from tensorwire.wire.frame import Opcode


@pytest.fixture
def srv() -> Iterator[tensorwire.ServerThread]:
    config = GenerationConfig(max_parts=4, max_transactions=3, transactions_per_owner=2, max_wait_seconds=5.0)
    with tensorwire.ServerThread(options=ServerOptions(generations=config)) as server:
        yield server


def _part(client: tensorwire.AsyncClient, txn: bytes, index: int, count: int, *, timeout: float = 2.0,
          name: str = "") -> asyncio.Future[tensorwire.Generation]:  # fmt: skip
    tensors = {name or f"t{index}": torch.full((256,), float(index))}
    return asyncio.ensure_future(
        client.publish_part("p", tensors, txn=txn, index=index, count=count, timeout=timeout)
    )


def _run(main: object) -> None:
    asyncio.run(asyncio.wait_for(main, 30))  # type: ignore[arg-type]


def _idle(srv: tensorwire.ServerThread, used: int) -> None:
    parts = srv.server.generation_ops.parts
    wait_for(lambda: not parts.open and srv.server.store.used == used, 10, "every part's bytes to be freed")


def test_a_transaction_of_more_parts_than_the_limit_is_refused(srv: tensorwire.ServerThread) -> None:
    async def main() -> None:
        async with await tensorwire.aconnect(srv.url) as c:
            with pytest.raises(LimitExceeded, match="a publish of 5 parts: at most 4"):
                await _part(c, os.urandom(16), 0, 5)

    _run(main())
    _idle(srv, 0)


def test_a_timeout_past_the_servers_longest_wait_is_refused(srv: tensorwire.ServerThread) -> None:
    async def main() -> None:
        async with await tensorwire.aconnect(srv.url) as c:
            with pytest.raises(LimitExceeded, match="waits at most 5s"):
                await _part(c, os.urandom(16), 0, 2, timeout=30)

    _run(main())


def test_open_transactions_are_bounded_per_connection_and_per_server(srv: tensorwire.ServerThread) -> None:
    async def main() -> None:
        async with await tensorwire.aconnect(srv.url) as a, await tensorwire.aconnect(srv.url) as b:
            held = [_part(a, os.urandom(16), 0, 2), _part(a, os.urandom(16), 0, 2)]
            with pytest.raises(LimitExceeded, match="this connection has parts in 2 multi-part publishes"):
                await _part(a, os.urandom(16), 0, 2)
            held.append(_part(b, os.urandom(16), 0, 2))  # the server's third
            parts = srv.server.generation_ops.parts
            await _until(lambda: len(parts.open) == 3)
            with pytest.raises(LimitExceeded, match="this server has open 3 multi-part publishes"):
                await _part(b, os.urandom(16), 0, 2)
            for future in held:  # and the held ones end at their timeout, each saying what came
                with pytest.raises(WaitTimeout, match="1 of 2 parts arrived"):
                    await future

    _run(main())
    _idle(srv, 0)


def test_parts_whose_names_collide_abort_the_whole_transaction(srv: tensorwire.ServerThread) -> None:
    async def main() -> None:
        async with await tensorwire.aconnect(srv.url) as a, await tensorwire.aconnect(srv.url) as b:
            txn = os.urandom(16)
            first = _part(a, txn, 0, 3, name="same")
            await _until(lambda: bool(srv.server.generation_ops.parts.open))
            second = _part(b, txn, 1, 3, name="same")
            for future in (first, second):
                with pytest.raises(PublishAborted, match=r"part 1 .* names 'p/same', as another part does"):
                    await future
            with pytest.raises(tensorwire.errors.KeyNotFound):
                await a.manifest("p")  # nothing of it is visible

    _run(main())
    _idle(srv, 0)


def test_an_incomplete_transaction_is_freed_at_its_timeout(srv: tensorwire.ServerThread) -> None:
    async def main() -> None:
        async with await tensorwire.aconnect(srv.url) as c:
            first = await c.publish("p", {"t0": torch.zeros(4)})
            used = srv.server.store.used
            part = _part(c, os.urandom(16), 1, 3, timeout=0.5)
            await _until(lambda: srv.server.store.used > used)  # held while it waits
            with pytest.raises(WaitTimeout, match=r"1 of 3 parts arrived \(missing: parts \[0, 2\]\)"):
                await part
            assert srv.server.store.used == used and not srv.server.generation_ops.parts.open
            assert (await c.manifest("p")).generation == first

    _run(main())


def test_a_closed_connection_aborts_the_transaction_for_every_part_at_once(
    srv: tensorwire.ServerThread,
) -> None:
    async def main() -> None:
        async with await tensorwire.aconnect(srv.url) as b:
            txn = os.urandom(16)
            a = await tensorwire.aconnect(srv.url)
            doomed = _part(a, txn, 0, 3, timeout=4.5)
            waiting = _part(b, txn, 1, 3, timeout=4.5)
            parts = srv.server.generation_ops.parts
            await _until(lambda: sum(len(t.parts) for t in parts.open.values()) == 2)
            started = asyncio.get_running_loop().time()
            await a.close()
            with pytest.raises(
                PublishAborted, match=r"its part 0 closed before the commit \(2 of 3 parts arrived\)"
            ):
                await waiting
            assert asyncio.get_running_loop().time() - started < 3  # not at the timeout
            with pytest.raises(PublishAborted, match="closed before the commit"):  # a late part: the same
                await _part(b, txn, 2, 3, timeout=4.5)
            doomed.cancel()

    _run(main())
    _idle(srv, 0)


async def _until(condition: object, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():  # type: ignore[operator]
        if loop.time() > deadline:
            raise TimeoutError(f"waited {timeout}s")
        await asyncio.sleep(0.01)


# -- GEN_GET_RANGES (the batched ranged read of sharded.load_state_dict) ---------------------------
@pytest.mark.parametrize(
    ("ranges", "error", "says"),
    [
        ([(0, 8), (1020, 8)], InvalidTensor, r"bytes 1020..1028 are not inside 'p/t0'"),
        ([(0, 1)] * 65537, ProtocolError, "65537 ranges: 1 to 65536"),
        ([(0, 1024)] * 80, LimitExceeded, "an answer of 81920 bytes exceeds 65536"),
    ],
    ids=["a-range-outside-the-tensor", "too-many-ranges", "too-many-bytes"],
)
def test_gen_get_ranges_is_bounded(ranges: list[tuple[int, int]], error: type[Exception], says: str) -> None:
    with tensorwire.ServerThread(options=ServerOptions(limits=Limits(max_request_bytes=65536))) as server:
        with tensorwire.connect(server.url) as c:
            c.publish("p", {"t0": torch.zeros(256)})

        async def main() -> None:
            channel = await open_channel(server.url, TransportOptions(10.0, 10.0), what="GEN_GET_RANGES")
            try:
                request = wg.encode_get_ranges(0, ranges, "p/t0")
                with pytest.raises(error, match=says):
                    await channel.call(Opcode.GEN_GET_RANGES, request, what="ranges")
            finally:
                await channel.close()

        _run(main())
