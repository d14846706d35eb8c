"""Nobody can lock the dashboard's users out from a handful of addresses (review 2 #8), and the
in-server page names flags ``tensorwire serve`` has (review 1 #11).

The login throttle's global bucket counts failed attempts only: successful logins never drain it,
a browser with a valid session is let through without touching it, and an address that logged in
is held only by its own bucket. Connections are capped per client address as well as in all. Real
pages on loopback (HTTPS where there is a login), real sockets from several 127.0.0.x addresses."""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import ssl
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="the dashboard extra (aiohttp) is not installed")

from test_dashboard_service import no_servers, running  # the page's test kit

from tensorwire.dashboard.app import Dashboard
from tensorwire.dashboard.guard import Limits
from tensorwire.security import TlsFiles, server_ssl_context, write_dev_certs
from tensorwire.testing.process import ServerProcess, wait_for

TOKEN = "the-token-of-the-dashboard-lockout-test"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


@pytest.fixture
def page(tmp_path: Path) -> Iterator[tuple[Dashboard, ssl.SSLContext]]:
    """A page with a login (beyond loopback, so HTTPS), and a client context trusting it."""
    certs = write_dev_certs(tmp_path / "certs", ["localhost", "127.0.0.1"], 1)
    server = server_ssl_context(TlsFiles(certs["server"], certs["server_key"], None))
    with running(Dashboard(no_servers, [], host="0.0.0.0", port=0, token=TOKEN, ssl_context=server)) as dash:
        yield dash, ssl.create_default_context(cafile=str(certs["ca"]))


def login(
    dash: Dashboard, client: ssl.SSLContext, token: str, source: str, cookie: str = ""
) -> tuple[int, str]:
    """POST /login from ``source``: (the status, the session cookie it set)."""
    conn = http.client.HTTPSConnection("127.0.0.1", dash.port, timeout=10, context=client,
                                       source_address=(source, 0))  # fmt: skip
    try:
        headers = {**FORM, **({"Cookie": cookie} if cookie else {})}
        conn.request("POST", "/login", body=urllib.parse.urlencode({"token": token}), headers=headers)
        answer = conn.getresponse()
        answer.read()
        found = re.match(r"(tw_session=[^;]+)", answer.getheader("Set-Cookie") or "")
        return answer.status, found.group(1) if found else ""
    finally:
        conn.close()


def drain(dash: Dashboard, client: ssl.SSLContext) -> None:
    """Wrong tokens from a few addresses until the global bucket is empty: a new address waits."""
    for n in range(Limits.login_global_burst // Limits.login_burst):
        for _ in range(Limits.login_burst):
            assert login(dash, client, "a-wrong-guess", f"127.0.0.{10 + n}")[0] == 403
    assert login(dash, client, TOKEN, "127.0.0.99")[0] == 429  # a stranger waits its turn, as it should


def test_successful_logins_never_drain_the_global_bucket(page: tuple[Dashboard, ssl.SSLContext]) -> None:
    """Before, every attempt drained it: the 21st login of the day, from anyone, got 429."""
    dash, client = page
    answers = [login(dash, client, TOKEN, f"127.0.1.{i}")[0] for i in range(Limits.login_global_burst + 5)]
    assert answers == [303] * len(answers)


def test_those_who_know_the_token_are_not_locked_out(page: tuple[Dashboard, ssl.SSLContext]) -> None:
    """A flood of wrong tokens from a few addresses empties the global bucket; before, that kept
    every browser at 429, even one already logged in or one whose address had logged in."""
    dash, client = page
    status, cookie = login(dash, client, TOKEN, "127.0.0.2")
    assert status == 303 and cookie
    drain(dash, client)
    assert login(dash, client, TOKEN, "127.0.0.3", cookie)[0] == 303  # a valid session: let through
    assert login(dash, client, TOKEN, "127.0.0.2")[0] == 303  # a new browser where one logged in
    assert login(dash, client, "a-wrong-guess", "127.0.0.2")[0] == 403  # its own bucket still counts


def test_connections_are_capped_per_client_address() -> None:
    """Before, one address could hold every one of the page's connections (64 in all)."""
    per_client = Limits.connections_per_client
    with running(Dashboard(no_servers, [], port=0)) as dash, contextlib.ExitStack() as stack:

        def connect(source: str) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", dash.port), timeout=10, source_address=(source, 0))
            stack.callback(sock.close)
            return sock

        for _ in range(per_client):
            connect("127.0.0.1")
        wait_for(lambda: dash._listener is not None and dash._listener.open == per_client, 10, "connections")
        one_more = connect("127.0.0.1")
        one_more.settimeout(5)
        assert one_more.recv(1) == b""  # closed at once, unanswered
        other = connect("127.0.0.2")
        other.sendall(f"GET /api/snapshot HTTP/1.1\r\nHost: 127.0.0.1:{dash.port}\r\n\r\n".encode())
        assert other.recv(12) == b"HTTP/1.1 200"  # another address still gets in


def test_the_in_server_page_names_the_serve_flag_of_its_bound() -> None:
    """``serve --dashboard-port``'s page refuses streams beyond ``--dashboard-max-streams``, and says
    so; before, it named ``--max-streams``, a flag of ``tensorwire dashboard`` only."""
    extra = ["--dashboard-port", "0", "--dashboard-max-streams", "1"]
    with ServerProcess(extra=extra) as srv, contextlib.ExitStack() as stack:
        found = re.search(r"tensorwire dashboard on http://127\.0\.0\.1:(\d+)/", srv.output())
        assert found, srv.output()
        port = int(found.group(1))
        answers = []
        for source in ("127.0.0.1", "127.0.0.2"):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
            stack.callback(sock.close)
            sock.sendall(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            answers.append(read_until(sock, b"max-streams" if answers else b"\r\n\r\n", 10))
        assert answers[0].startswith(b"HTTP/1.1 200")
        assert answers[1].startswith(b"HTTP/1.1 429") and b"(--dashboard-max-streams)" in answers[1], answers


def read_until(sock: socket.socket, marker: bytes, within: float) -> bytes:
    """What ``sock`` sends until ``marker`` (or it closes, or ``within`` seconds pass)."""
    deadline, got = time.monotonic() + within, b""
    while marker not in got and time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            break
        if not chunk:
            break
        got += chunk
    return got
