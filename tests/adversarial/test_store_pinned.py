"""Item 10: bytes that readers pin count against the capacity until they are released.

A GET whose answer is never read keeps the version it read alive after a delete and a new put
(the issue saw +1.2 GiB under a 256 MiB capacity). Those bytes now count in ``used`` (``pinned``
in STATUS), so a put that does not fit beside them is refused with CapacityExceeded instead of
growing the process, and the stall watchdog bounds how long an unread answer can pin them.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import tensorwire
from tensorwire._aio import run
from tensorwire.cli.status import ask_status
from tensorwire.client import ClientOptions
from tensorwire.errors import CapacityExceeded
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.types import Address, MiB
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import Header, Opcode, encode_frame_head

BIG = torch.ones(6 * MiB)  # 24 MiB: far more than the socket buffers between the two ends


def status(url: str) -> dict[str, Any]:
    return run(ask_status(url, ClientOptions(timeout=10.0)))


@contextlib.contextmanager
def unread_get(url: str, name: str) -> Iterator[socket.socket]:
    """A connection that asks for ``name`` and never reads the answer (a tiny receive buffer)."""
    address = Address.parse(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect((address.host, address.port))
        block = wm.encode_names([name])
        header = Header(1, Opcode.GET, 0, ChecksumKind.XXH3_64, 1, len(block), 1 * MiB, 0)
        sock.sendall(encode_frame_head(header, block))
        wait_for(lambda: status(url)["in_flight"] >= 1, 10, "the server to start sending the answer")
        yield sock
    finally:
        sock.close()


def test_a_put_beside_pinned_old_versions_is_refused_until_they_are_released() -> None:
    with ServerProcess(capacity="64MiB") as srv, tensorwire.connect(srv.url, retries=0) as c:
        c.put("w", BIG)
        with unread_get(srv.url, "w"):
            c.delete("w")
            c.put("w", BIG)  # 24 MiB pinned + 24 MiB stored: fits in 64 MiB
            with pytest.raises(CapacityExceeded, match="pinned by readers"):
                c.put("w2", BIG)  # 72 MiB would be held: refused, not grown into
            assert status(srv.url)["store"]["pinned"] == BIG.nbytes
        wait_for(lambda: status(srv.url)["store"]["pinned"] == 0, 10, "the reader's pin to be released")
        c.put("w2", BIG)  # once the reader is gone, the room is back


def test_the_stall_watchdog_bounds_how_long_an_unread_answer_pins() -> None:
    stalls = ["--stall-timeout", "0.5"]
    with ServerProcess(capacity="64MiB", extra=stalls) as srv, tensorwire.connect(srv.url, retries=0) as c:
        c.put("w", BIG)
        with unread_get(srv.url, "w"):
            c.delete("w")
            assert status(srv.url)["store"]["pinned"] == BIG.nbytes
            wait_for(lambda: status(srv.url)["store"]["pinned"] == 0, 10, "the stalled reader to be cut off")
            assert status(srv.url)["store"]["used"] == 0
