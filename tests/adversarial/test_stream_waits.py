"""Two tasks of one stream may wait for the same readiness (over TLS a send can need the peer's
records while the session reads). The second joins the first's wait; when that wait has already been
woken but its task has not run yet, the second must still yield, or a retry that wants to wait again
(a TLS record only half in) spins on the loop forever and the first task never runs."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tensorwire._aio import NO_UVLOOP_ENV, new_event_loop
from tensorwire.transport.tcp import TcpStream


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_a_joined_wait_that_was_woken_already_lets_its_owner_run(
    loop_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if loop_kind == "asyncio":
        monkeypatch.setenv(NO_UVLOOP_ENV, "1")
    else:
        pytest.importorskip("uvloop")
        monkeypatch.delenv(NO_UVLOOP_ENV, raising=False)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.create_connection(listener.getsockname(), timeout=5)
        ours, _ = listener.accept()

    async def main() -> list[str]:
        stream = TcpStream(ours)
        order: list[str] = []

        async def owner() -> None:
            await stream._readable()
            order.append("owner")

        first = asyncio.get_running_loop().create_task(owner())
        await asyncio.sleep(0)  # the owner waits for readability now
        waiter = stream._read_waiter
        assert waiter is not None and not first.done()
        waiter.set_result(None)  # what the loop's readiness callback does; the owner has not run yet
        await stream._readable()  # joins the woken wait
        order.append("joiner")
        await asyncio.wait_for(first, 5)
        await stream.close()
        return order

    loop = new_event_loop()
    try:
        order = loop.run_until_complete(main())
    finally:
        loop.close()
        theirs.close()
    assert order[0] == "owner", order
