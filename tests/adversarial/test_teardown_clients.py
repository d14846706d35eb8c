"""A client whose connection is closed while a send is parked on it, or whose peer vanishes,
raises a typed error and lives on (issue 32, class 1, the client side).

A client's own deadline closes the connection its request is stuck on (``FrameMux._expire``)
while the send is parked waiting for room, with the stream's read watch armed (it watches for what
the server sends unasked). Under uvloop the close re-armed the poll on the descriptor it was about
to close and left the parked writer registered: libuv aborted the client process. Each scenario
runs in a child process (an abort would end the test runner), on uvloop and on plain asyncio, over
tcp:// and tls://, against a peer that takes the connection and never reads.

A connection lent to a thread (``tcp.LentTcp``) may be closed by its owner while the borrower is
asleep in poll(2): the borrower wakes with ConnectionLost at once (not at its deadline), and the
descriptor is closed once it has let go, never under it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tensorwire
from tensorwire._aio import NO_UVLOOP_ENV
from tensorwire.client import Client
from tensorwire.errors import ConnectionLost
from tensorwire.security import write_dev_certs
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.testing.process import wait_for
from tensorwire.transport.ranged import RangedTransport

CHILD = r"""
import asyncio, socket, ssl, struct, sys, threading
from pathlib import Path
from tensorwire import _aio
from tensorwire.errors import TensorwireError
from tensorwire.security import TlsFiles, client_ssl_context
from tensorwire.transport import tcp, tls
from tensorwire.transport.ranged import RangedTransport
from tensorwire.types import Address
from tensorwire.wire.frame import Opcode

scheme, certs, scenarios = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
BIG = memoryview(bytearray(64 << 20))  # far more than the socket buffers between the two ends


class Peer(threading.Thread):
    # Takes one connection (shakes hands for tls://) and never reads from it.
    def __init__(self):
        super().__init__(daemon=True)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.conn = None
        self.ready = threading.Event()

    def run(self):
        conn, _ = self.listener.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        if scheme == "tls":
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certs / "server.pem", certs / "server.key")
            conn = context.wrap_socket(conn, server_side=True)
        self.conn = conn
        self.ready.set()

    def reset(self):
        self.conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.conn.close()


async def main(scenario):
    peer = Peer()
    peer.start()
    address = Address(scheme, "127.0.0.1", peer.port)
    if scheme == "tls":
        stream = await tls.connect(address, 5, client_ssl_context(TlsFiles(ca=certs / "ca.pem")))
    else:
        stream = await tcp.connect(address, 5)
    await asyncio.get_running_loop().run_in_executor(None, peer.ready.wait, 5)
    transport = RangedTransport(address, stream, timeout=0.5 if scenario == "deadline" else 30)
    call = asyncio.ensure_future(transport.call(Opcode.PING, b"", [BIG], what="a large frame"))
    await asyncio.sleep(0.3)  # the send fills the buffers and parks (any moment after will do)
    assert not call.done(), call
    if scenario == "close":
        await transport.close()
    elif scenario == "reset":
        peer.reset()
    try:
        await asyncio.wait_for(call, 10)
    except TensorwireError as exc:
        print(scenario, "typed", type(exc).__name__, flush=True)
    await transport.close()
    peer.listener.close()

for scenario in scenarios:  # one process for all: an abort in any ends it, which the test reports
    _aio.run(main(scenario))
    print(scenario, "survived", flush=True)
"""


def _certs(directory: Path) -> Path:
    """The dev certificates under the names the child reads."""
    paths = write_dev_certs(directory)
    for key, name in (("ca", "ca.pem"), ("server", "server.pem"), ("server_key", "server.key")):
        (directory / name).write_bytes(paths[key].read_bytes())
    return directory


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _certs(tmp_path_factory.mktemp("certs"))


# Each scenario: what ends the parked send, and the typed error the caller must get.
SCENARIOS = {"deadline": "TransferTimeout", "close": "ConnectionLost", "reset": "ConnectionLost"}


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("scheme", ["tcp", "tls"])
def test_a_client_closed_under_a_parked_send_raises_and_lives(certs: Path, loop: str, scheme: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != NO_UVLOOP_ENV}
    if loop == "asyncio":
        env[NO_UVLOOP_ENV] = "1"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, scheme, str(certs), *SCENARIOS],
        check=False, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    out = child.stdout + child.stderr
    assert child.returncode == 0, f"the client process died ({child.returncode}):\n{out[-3000:]}"
    for scenario, error in SCENARIOS.items():
        assert f"{scenario} typed {error}" in out and f"{scenario} survived" in out, out[-3000:]


# -- a lent connection closed by its owner while its borrower waits in poll(2) -----------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(["tcp://127.0.0.1:0"], store=TensorStore(1 << 26)) as srv:
        yield srv


def _transport(client: Client) -> RangedTransport:
    t = client._async.current_transport
    assert isinstance(t, RangedTransport), t
    return t


def test_an_owner_closing_a_lent_connection_wakes_its_borrower(server: ServerThread) -> None:
    with tensorwire.connect(server.url, retries=0, timeout=30.0) as c:
        c.put("teardown/x", torch.ones(4))  # through the loop, which lends the connection after it
        t = _transport(c)
        loan = t._lending.loan
        assert loan is not None
        sock = t._stream._sock  # type: ignore[attr-defined]
        outcome: list[BaseException | object] = []

        def borrow() -> None:
            try:  # a generation that never comes: the server parks the wait, the borrower polls
                outcome.append(t.run_inline(lambda tr: tr.wait("teardown/never", 0, 20.0), 30.0))
            except BaseException as exc:
                outcome.append(exc)

        borrower = threading.Thread(target=borrow, daemon=True)
        borrower.start()
        wait_for(lambda: loan.borrower is not None, 5, "the borrower to start its call")
        time.sleep(0.1)  # it is asleep in poll(2) by now (any moment after the call began will do)
        started = time.monotonic()
        c._thread.call(t.close(), 5.0, "closing the lent connection")
        borrower.join(5)
        assert not borrower.is_alive(), "the borrower slept on after its connection was closed"
        assert time.monotonic() - started < 5
        assert len(outcome) == 1 and isinstance(outcome[0], ConnectionLost), outcome
        wait_for(lambda: sock.fileno() == -1, 5, "the socket to be closed once the borrower let go")
