"""The dashboard page as a network service (issue 32, class 8): a DNS-rebound name is refused on
the loopback page, no login without TLS beyond loopback, login attempts are throttled, event
streams are bounded in all and per client, a reader that stops reading is dropped, silent and
half-sent connections are closed and capped, and inside a server the page runs off its event loop.

Real pages on loopback port 0 (in this process, on a loop thread of the test's own, or as
``tensorwire dashboard``), real sockets; every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="the dashboard extra (aiohttp) is not installed")

from tensorwire._aio import run
from tensorwire.dashboard.app import Dashboard
from tensorwire.dashboard.collect import Node
from tensorwire.dashboard.guard import Limits
from tensorwire.security import TlsFiles, server_ssl_context, write_dev_certs
from tensorwire.server import ServerThread
from tensorwire.testing.process import wait_for

TOKEN = "the-token-of-the-dashboard-service-test"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


async def no_servers() -> list[Node]:
    return []


LOOPS: dict[int, asyncio.AbstractEventLoop] = {}  # id(dashboard) -> the loop it runs on


@contextlib.contextmanager
def running(dashboard: Dashboard) -> Iterator[Dashboard]:
    """``dashboard`` started on an event loop of its own thread, closed (and joined) at exit."""
    started, failed = threading.Event(), []
    loop_box: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def main() -> None:
        stop = asyncio.Event()
        loop_box.append((asyncio.get_running_loop(), stop))
        LOOPS[id(dashboard)] = asyncio.get_running_loop()
        try:
            await dashboard.start()
        except BaseException as exc:
            failed.append(exc)
            started.set()
            return
        started.set()
        try:
            await stop.wait()
        finally:
            await dashboard.close()

    thread = threading.Thread(target=run, args=(main(),), daemon=True)  # uvloop, as the CLI
    thread.start()
    assert started.wait(30), "the page did not start"
    if failed:
        raise failed[0]
    try:
        yield dashboard
    finally:
        loop, stop = loop_box[0]
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        LOOPS.pop(id(dashboard), None)
        assert not thread.is_alive()


def get(port: int, path: str = "/", host: str | None = None, **headers: str) -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        conn.putheader("Host", host if host is not None else f"127.0.0.1:{port}")
        for key, value in headers.items():
            conn.putheader(key, value)
        conn.endheaders()
        answer = conn.getresponse()
        answer.read()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}
    finally:
        conn.close()


def test_a_rebound_host_name_is_refused_on_the_loopback_page() -> None:
    """A site elsewhere that points its name at 127.0.0.1 reaches the page with its own name in
    Host; only this machine's names (and --allowed-host's) are answered."""
    with running(Dashboard(no_servers, [], port=0)) as page:
        for host in ("evil.example", f"evil.example:{page.port}", "127.0.0.1.evil.example", "", "a b"):
            assert get(page.port, host=host)[0] == 403, host
            assert get(page.port, "/api/snapshot", host=host)[0] == 403, host
        for host in (f"127.0.0.1:{page.port}", "localhost", f"LOCALHOST:{page.port}", f"[::1]:{page.port}"):
            assert get(page.port, host=host)[0] == 200, host
    with running(Dashboard(no_servers, [], port=0, allowed_hosts=["dash.internal"])) as page:
        assert get(page.port, host="dash.internal")[0] == 200
        assert get(page.port, host="evil.example")[0] == 403


def test_beyond_loopback_the_page_refuses_plain_http(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tls-cert"):
        Dashboard(no_servers, [], host="0.0.0.0", port=0, token=TOKEN)
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    refused = subprocess.run(
        [sys.executable, "-m", "tensorwire.cli", "dashboard", "tcp://127.0.0.1:1", "--host", "0.0.0.0",
         "--port", "0", "--token-file", str(token)],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "--page-tls-cert" in refused.stderr


@pytest.fixture
def tls(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(the page's server context, a client context trusting it)."""
    certs = write_dev_certs(tmp_path / "certs", ["localhost", "127.0.0.1"], 1)
    server = server_ssl_context(TlsFiles(certs["server"], certs["server_key"], None))
    return server, ssl.create_default_context(cafile=str(certs["ca"]))


def login(port: int, client: ssl.SSLContext, token: str) -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=client)
    try:
        conn.request("POST", "/login", body=urllib.parse.urlencode({"token": token}), headers=FORM)
        answer = conn.getresponse()
        answer.read()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}
    finally:
        conn.close()


def test_login_attempts_are_throttled(tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server, client = tls
    with running(Dashboard(no_servers, [], host="0.0.0.0", port=0, token=TOKEN, ssl_context=server)) as page:
        answers = [login(page.port, client, f"guess-{i}")[0] for i in range(Limits.login_burst)]
        assert answers == [403] * Limits.login_burst
        status, headers = login(page.port, client, "one-guess-too-many")
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert login(page.port, client, TOKEN)[0] == 429  # even the right token waits its turn
        assert page.throttle.refused == 2


def test_the_throttle_holds_in_all_and_its_table_is_bounded() -> None:
    from tensorwire.dashboard.guard import LoginThrottle

    now = [0.0]
    limits = Limits(login_burst=2, login_global_burst=5, login_global_per_minute=60, throttle_table=4)
    throttle = LoginThrottle(limits, clock=lambda: now[0])
    waits = []
    for i in range(100):  # one wrong try each from many addresses
        waits.append(wait := throttle.admit(f"10.0.0.{i}"))
        if not wait:
            throttle.failed(f"10.0.0.{i}")
    assert waits[:5] == [0.0] * 5 and all(w > 0 for w in waits[5:])
    assert len(throttle) == 4  # addresses remembered: bounded
    now[0] += 1.0  # a second later one more try in all, for anyone
    assert throttle.admit("10.0.1.1") == 0.0
    throttle.failed("10.0.1.1")
    assert throttle.admit("10.0.1.2") > 0


def open_stream(port: int, source: str = "127.0.0.1") -> tuple[socket.socket, bytes]:
    """An /events request from ``source``; (its socket, the answer's first bytes)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    sock.sendall(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    return sock, sock.recv(12)


def test_event_streams_are_bounded_per_client_and_in_all() -> None:
    """Each client address holds at most ``streams_per_client`` streams, all of them together at
    most ``max_streams`` (the defaults; loopback has many source addresses: 127.0.0.x)."""
    per_client, in_all = Limits.streams_per_client, Limits.max_streams
    with running(Dashboard(no_servers, [], port=0)) as page, contextlib.ExitStack() as stack:

        def stream(source: str) -> bytes:
            sock, head = open_stream(page.port, source)
            stack.callback(sock.close)
            return head

        assert [stream("127.0.0.1") for _ in range(per_client)] == [b"HTTP/1.1 200"] * per_client
        assert stream("127.0.0.1") == b"HTTP/1.1 429"  # one more from the same address
        others = [f"127.0.0.{2 + i // per_client}" for i in range(in_all - per_client)]
        assert {stream(source) for source in others} == {b"HTTP/1.1 200"}  # other addresses: their share
        assert stream("127.0.0.99") == b"HTTP/1.1 429"  # but no more than max_streams in all


def test_a_stream_reader_that_stops_reading_is_dropped() -> None:
    """Snapshots of 4 MiB each to a reader that reads nothing: its stream is cut after
    write_timeout, the page holds no queue for it, and its slot is free again."""
    limits = Limits(write_timeout=0.5)
    page = Dashboard(no_servers, [], port=0, limits=limits, interval=3600)
    big: dict[str, Any] = {"t": 0, "servers": [], "blob": "x" * (4 << 20)}
    with running(page), socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.settimeout(10)
        sock.connect(("127.0.0.1", page.port))
        sock.sendall(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{page.port}\r\n\r\n".encode())
        for i in range(3):
            _publish(page, {**big, "t": i})
        wait_for(lambda: not page.streams.open, 10, "the stalled stream to be dropped")
        assert page._listener is not None
        wait_for(lambda: page._listener.open == 0, 10, "its connection to be closed")


def _publish(page: Dashboard, doc: dict[str, Any]) -> None:
    asyncio.run_coroutine_threadsafe(page.publish(doc), LOOPS[id(page)]).result(10)


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def test_silent_and_half_sent_connections_are_closed_and_capped() -> None:
    limits = Limits(max_connections=4, idle_timeout=0.5, read_timeout=0.5)
    with running(Dashboard(no_servers, [], port=0, limits=limits)) as page, contextlib.ExitStack() as stack:
        silent = [socket.create_connection(("127.0.0.1", page.port), timeout=10) for _ in range(3)]
        half = socket.create_connection(("127.0.0.1", page.port), timeout=10)
        half.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # and never the end
        for sock in (*silent, half):
            stack.callback(sock.close)
        wait_for(lambda: page._listener is not None and page._listener.open == 4, 10, "4 connections")
        extra = socket.create_connection(("127.0.0.1", page.port), timeout=10)
        stack.callback(extra.close)
        assert _closed_by_peer(extra, 5.0)  # over the cap: closed at once
        assert page._listener is not None and page._listener.refused >= 1
        assert all(_closed_by_peer(sock, 5.0) for sock in (*silent, half))  # after idle_timeout
        wait_for(lambda: page._listener is not None and page._listener.open == 0, 10, "slots freed")
        assert get(page.port)[0] == 200  # and the page serves again


def test_a_login_form_that_never_arrives_is_given_up(tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server, client = tls
    limits = Limits(read_timeout=0.5)
    page = Dashboard(no_servers, [], host="0.0.0.0", port=0, token=TOKEN, ssl_context=server, limits=limits)
    with running(page):
        raw = socket.create_connection(("127.0.0.1", page.port), timeout=10)
        with client.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(b"POST /login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/"
                         b"x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\ntoken=")  # fmt: skip
            started = time.monotonic()
            sock.settimeout(10)
            head = sock.recv(12)
            assert head == b"HTTP/1.1 408" and time.monotonic() - started < 5


def test_inside_a_server_the_page_runs_off_its_event_loop() -> None:
    """``serve --dashboard-port``: with the server's event loop busy (here: asleep for 2 s), the
    page still answers at once; it lives on a thread and loop of its own."""
    from tensorwire.cli.serve import Page, _start_page

    with ServerThread() as srv:
        thread = srv._thread.call(_start_page(srv.server, Page(0, "127.0.0.1")), 30, "the page")
        try:
            port = thread.dashboard.port
            wait_for(lambda: get(port, "/api/snapshot")[0] == 200, 10, "the page")
            blocked = srv._thread.submit(_asleep(2.0))
            started = time.monotonic()
            assert get(port)[0] == 200 and get(port, "/api/snapshot")[0] == 200
            assert time.monotonic() - started < 1.5, "the page waited for the server's loop"
            blocked.result(10)
        finally:
            srv._thread.call(asyncio.to_thread(thread.close), 30, "the page to close")


async def _asleep(seconds: float) -> None:
    time.sleep(seconds)  # blocks the loop it runs on, as a busy serving loop would
