"""What each transport can do is asked of the object it opened (transport/base.py), and
``open_channel`` is the one place that opens and checks a frame-protocol connection."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tensorwire import transport as transports
from tensorwire.errors import UnsupportedTransport
from tensorwire.server import ServerThread
from tensorwire.transport.base import FrameChannel, Ranged, Resumable, Viewable
from tensorwire.types import Address
from tensorwire.wire.frame import Opcode

URLS = ["tcp://127.0.0.1:0", "memory://capabilities", "shm://127.0.0.1:0", "grpc://127.0.0.1:0"]
# scheme: (FrameChannel, Ranged, Resumable, Viewable, parallel)
EXPECTED = {
    "tcp": (True, True, True, False, True),
    "memory": (True, True, True, False, False),
    "shm": (True, False, False, True, False),
    "grpc": (False, False, False, False, False),
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(URLS) as srv:
        yield srv


def _address(server: ServerThread, scheme: str) -> Address:
    return next(a for a in server.addresses if a.scheme == scheme)


@pytest.mark.parametrize("scheme", list(EXPECTED))
def test_each_transport_says_what_it_can_do(server: ServerThread, scheme: str) -> None:
    async def ask() -> tuple[bool, ...]:
        t = await transports.open_transport(_address(server, scheme), transports.TransportOptions(5.0, 5.0))
        try:
            kinds = (FrameChannel, Ranged, Resumable, Viewable)
            return (*(isinstance(t, kind) for kind in kinds), isinstance(t, Ranged) and t.parallel)
        finally:
            await t.close()

    assert asyncio.run(ask()) == EXPECTED[scheme]
    # The table that lets a command refuse an address before connecting agrees with the objects.
    assert (scheme in transports.CHANNEL_SCHEMES) == EXPECTED[scheme][0]


def test_open_channel_refuses_what_cannot_carry_frames_naming_the_scheme(server: ServerThread) -> None:
    options = transports.TransportOptions(5.0, 5.0)

    async def go() -> None:
        channel = await transports.open_channel(str(_address(server, "tcp")), options, what="a test")
        try:
            await channel.call(Opcode.PING, b"", what="a ping")
        finally:
            await channel.close()
        with pytest.raises(UnsupportedTransport, match=r"a test needs the frame protocol .* not grpc://"):
            await transports.open_channel(_address(server, "grpc"), options, what="a test")

    asyncio.run(go())
    with pytest.raises(ValueError, match="not grpcs://"):  # refused before connecting anywhere
        transports.check_channel("grpcs://127.0.0.1:1", what="a test")
