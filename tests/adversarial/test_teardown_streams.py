"""No peer behaviour ends the server process: tear-down on every stream, on both event loops (issue 32,
class 1).

A connection the stall watchdog cut while the server's send was parked on it aborted the whole
server under uvloop: the socket was closed while the loop still polled it (its writer was removed
only after the parked send woke, and its reader's removal re-armed the poll on the doomed
descriptor), and libuv aborts on a closed descriptor it polls. Every in-memory tensor was lost.
Now a stream stops the loop watching its descriptor, for reads and writes, before it closes it.

Each path runs as a real ``tensorwire serve`` process (an abort would otherwise take the test
runner with it), on uvloop and on plain asyncio (``TENSORWIRE_NO_UVLOOP=1``): tcp://, tls:// and
the shm:// control connection, each with a reader that asks for a large tensor and never reads
(its read watch armed first), a peer cut mid-send, a half-sent frame and a stalled TLS handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tensorwire
from tensorwire._aio import NO_UVLOOP_ENV, run
from tensorwire.cli.status import ask_status
from tensorwire.client import ClientOptions
from tensorwire.errors import ConnectionLost, TensorwireError
from tensorwire.security import TlsFiles, write_dev_certs
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.transport.tcp import TcpStream
from tensorwire.types import Address, MiB, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import HEADER_BYTES, Header, Opcode, encode_frame_head

BIG = torch.ones(4 * MiB)  # 16 MiB: far more than the socket buffers between the two ends
LOOPS = ["uvloop", "asyncio"]


class Served:
    """A server process on tcp://, tls:// and shm:// with short watchdog deadlines."""

    def __init__(self, srv: ServerProcess, certs: dict[str, Path]) -> None:
        self.srv = srv
        self.certs = certs
        self.urls = {Address.parse(url).scheme: url for url in srv.urls}

    def client(self, scheme: str) -> tensorwire.Client:
        return tensorwire.connect(
            self.urls[scheme], retries=0, timeout=10.0, tls=TlsFiles(ca=self.certs["ca"])
        )

    def cuts(self) -> int:
        return self.srv.output().count("no progress for")

    def assert_alive(self, scheme: str = "tcp") -> None:
        """Still running, and still holding what it held (the tensor put before the attack)."""
        try:
            with self.client(scheme) as c:
                assert torch.equal(c.get("big"), BIG)
        except TensorwireError:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.srv.proc.wait(5)  # an abort takes a moment (its core dump)
            if self.srv.proc.poll() is None:
                raise
        code = self.srv.proc.poll()
        assert code is None, f"the server died (exit {code}):\n{self.srv.output()[-2000:]}"


class Servers:
    """One server per event loop for the module, started again when a test killed it, so that
    each test stands on its own (before the fix, the first abort would fail every later test)."""

    def __init__(self, certs: dict[str, Path]) -> None:
        self.certs = certs
        self.running: dict[str, Served] = {}

    def get(self, loop: str) -> Served:
        served = self.running.get(loop)
        if served is not None and served.srv.proc.poll() is None:
            return served
        self.running[loop] = served = self._start(loop)
        return served

    def _start(self, loop: str) -> Served:
        env = {NO_UVLOOP_ENV: "1"} if loop == "asyncio" else {}
        tls = ["--tls-cert", str(self.certs["server"]), "--tls-key", str(self.certs["server_key"])]
        timeouts = ["--stall-timeout", "0.3", "--auth-timeout", "0.5", "--idle-timeout", "1"]
        extra = ["--listen", "tls://127.0.0.1:0", "--listen", "shm://127.0.0.1:0", *tls, *timeouts]
        with pytest.MonkeyPatch.context() as mp:  # the child inherits the environment
            mp.delenv(NO_UVLOOP_ENV, raising=False)
            for key, value in env.items():
                mp.setenv(key, value)
            srv = ServerProcess(capacity="256MiB", extra=extra)
        served = Served(srv, self.certs)
        try:
            with served.client("tcp") as c:
                c.put("big", BIG)
        except BaseException:
            srv.stop()
            raise
        return served

    def close(self) -> None:
        for served in self.running.values():
            served.srv.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    servers = Servers(write_dev_certs(tmp_path_factory.mktemp("certs")))
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture(params=LOOPS)
def served(request: pytest.FixtureRequest, servers: Servers) -> Served:
    return servers.get(request.param)


def _get_frame(name: str) -> bytes:
    block = wm.encode_names([name])
    return encode_frame_head(Header(1, Opcode.GET, 0, ChecksumKind.XXH3_64, 1, len(block), 1 * MiB, 0), block)


@contextlib.contextmanager
def raw(served: Served, scheme: str) -> Iterator[socket.socket]:
    """A connection with a tiny receive buffer (TLS set up for tls://) that the test drives."""
    address = Address.parse(served.urls[scheme])
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
    try:
        sock.connect((address.host, address.port))
        if scheme == "tls":
            context = ssl.create_default_context(cafile=str(served.certs["ca"]))
            sock = context.wrap_socket(sock, server_hostname=address.host)
        yield sock
    finally:
        sock.close()


def _unread_get(sock: socket.socket) -> None:
    """Ask for the large tensor in two pieces, so the server's read waits (its read watch armed)
    before the request is whole; then never read the answer."""
    frame = _get_frame("big")
    sock.sendall(frame[:8])
    time.sleep(0.05)  # not a synchronisation: only makes the server wait on its read watch first
    sock.sendall(frame[8:])


@pytest.mark.parametrize("scheme", ["tcp", "tls", "shm"])
def test_a_watchdog_cut_mid_send_leaves_the_server_running(served: Served, scheme: str) -> None:
    before = served.cuts()
    with raw(served, scheme) as sock:
        _unread_get(sock)
        wait_for(lambda: served.cuts() > before or served.srv.proc.poll() is not None, 10, "the stall cut")
        served.assert_alive(scheme)


def test_a_peer_cut_mid_send_leaves_the_server_running(served: Served) -> None:
    for _ in range(3):
        with raw(served, "tcp") as sock:
            _unread_get(sock)
            time.sleep(0.05)  # the server fills the buffers and parks its send (any moment will do)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
    served.assert_alive()


def test_a_half_sent_frame_is_cut_and_the_server_runs_on(served: Served) -> None:
    block = wm.encode_records([TensorMeta("half", torch.float32, (1 << 20,), 4 << 20)])
    header = Header(1, Opcode.PUT, 0, ChecksumKind.XXH3_64, 1, len(block), 1 * MiB, 4 << 20)
    before = served.cuts()
    with raw(served, "tcp") as sock:
        sock.sendall(encode_frame_head(header, block) + bytes(1 << 20))  # a quarter of the data
        wait_for(lambda: served.cuts() > before, 10, "the stall cut")
    served.assert_alive()


def test_a_stalled_tls_handshake_is_closed_at_the_auth_deadline(served: Served) -> None:
    address = Address.parse(served.urls["tls"])
    with socket.create_connection((address.host, address.port), timeout=10) as sock:
        sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # the start of a ClientHello
        assert sock.recv(1) == b"", "the handshake that never finished was not closed"
    served.assert_alive("tls")


@pytest.mark.parametrize("scheme", ["tcp", "tls", "shm"])
def test_an_idle_connection_is_closed_and_the_server_runs_on(served: Served, scheme: str) -> None:
    with raw(served, scheme) as sock:
        _request(sock, Opcode.PING, b"", 1)  # a request served, then nothing: its read watch armed
        assert sock.recv(1) == b"", "the idle connection was not closed"
    served.assert_alive(scheme)


def _status_store(served: Served) -> dict[str, int]:
    store = run(ask_status(served.urls["tcp"], ClientOptions(timeout=10.0)))["store"]
    assert isinstance(store, dict)
    return store


def _request(sock: socket.socket, opcode: int, block: bytes, rid: int) -> None:
    """Send a request without data and read its (small) answer whole."""
    sock.sendall(
        encode_frame_head(Header(1, opcode, 0, ChecksumKind.XXH3_64, rid, len(block), 1 * MiB, 0), block)
    )
    head = _recv_exactly(sock, HEADER_BYTES)
    _recv_exactly(sock, struct.unpack_from("<I", head, 16)[0])  # its metadata block


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        piece = sock.recv(n - len(data))
        assert piece, "the server closed the connection"
        data += piece
    return data


def test_an_shm_put_left_half_committed_is_dropped_with_its_connection(served: Served) -> None:
    block = wm.encode_records([TensorMeta("shm-half", torch.float32, (1 << 20,), 4 << 20)])
    before = served.cuts()
    with raw(served, "shm") as sock:
        _request(sock, Opcode.SHM_ATTACH, b"", 1)
        _request(sock, Opcode.SHM_PUT, block, 2)  # a segment handed out, the put open
        assert _status_store(served)["reserved"] >= 4 << 20
        commit = encode_frame_head(
            Header(1, Opcode.SHM_COMMIT, 0, ChecksumKind.XXH3_64, 3, 8, 1 * MiB, 0), bytes(8)
        )
        sock.sendall(commit[:20])  # half of its header, then nothing
        wait_for(lambda: served.cuts() > before, 10, "the stall cut")
        wait_for(lambda: _status_store(served)["reserved"] == 0, 10, "the open put to be dropped")
    served.assert_alive("shm")


# -- two waits on one stream ----------------------------------------------------------------------


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        near = socket.create_connection(listener.getsockname())
        far, _ = listener.accept()
    return near, far


@pytest.mark.parametrize("loop", LOOPS)
def test_close_wakes_a_read_and_a_second_wait_for_the_same_readiness(loop: str) -> None:
    """Over TLS a send may need the peer's records while the session reads (and a read may need
    room to write while a send waits): the second wait joins the first rather than replace it,
    whose task nothing would wake again, not even close (it would hang with its slot)."""

    async def main() -> None:
        near, far = _tcp_pair()
        try:
            stream = TcpStream(near)
            reading = asyncio.ensure_future(stream.recv_into(memoryview(bytearray(8))))
            await asyncio.sleep(0)  # a turn: the read parks (nothing was sent)
            second = asyncio.ensure_future(stream._readable())  # what TlsStream.send does on WANT_READ
            await asyncio.sleep(0)
            await stream.close()
            with pytest.raises(ConnectionLost):
                await asyncio.wait_for(reading, 5)
            await asyncio.wait_for(second, 5)
        finally:
            far.close()

    factory = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
