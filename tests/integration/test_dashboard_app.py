"""``tensorwire dashboard`` (a child process) against real servers on loopback port 0: its
server-sent-events stream sends snapshots, beyond loopback it asks for the servers' token (and
never sends the token back), a down server is shown with its reason within the timeout, it reaches
mutual-TLS servers with the client certificate every command takes (--tls-cert/--tls-key) while
serving its page with its own (--page-tls-cert/--page-tls-key), and ``serve --dashboard-port``
serves the server's own page."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="the dashboard extra (aiohttp) is not installed")

from dashboard_kit import DashboardProcess

from tensorwire.ps import ParamServer
from tensorwire.security import TlsFiles, write_dev_certs, write_token_file
from tensorwire.server import ServerThread
from tensorwire.server.options import MetricsOptions, ServerOptions
from tensorwire.testing.process import ServerProcess, wait_for

TOKEN = "the-servers-token-for-the-dashboard-test"


CONTEXT: dict[str, ssl.SSLContext] = {}  # the client context for https:// pages of a test


def request(
    url: str, method: str = "GET", body: str | None = None, **headers: str
) -> tuple[int, dict[str, str], str]:
    """One HTTP(S) request (no redirects followed): status, headers, body."""
    parts = urllib.parse.urlsplit(url)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=10, context=CONTEXT["https"])
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, parts.path or "/", body=body, headers=headers)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read().decode()
    finally:
        conn.close()


def snapshot(url: str, **headers: str) -> dict[str, Any]:
    status, _, body = request(url + "api/snapshot", **headers)
    assert status == 200, (status, body)
    doc: dict[str, Any] = json.loads(body)
    return doc


def events(url: str, count: int, **headers: str) -> list[dict[str, Any]]:
    """The first ``count`` snapshots of the SSE stream (each within the socket's timeout)."""
    parts = urllib.parse.urlsplit(url)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=10, context=CONTEXT["https"])
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", "/events", headers=headers)
        answer = conn.getresponse()
        assert answer.status == 200 and answer.getheader("Content-Type") == "text/event-stream"
        docs = []
        while len(docs) < count:
            line = answer.fp.readline().decode()
            if line.startswith("data: "):
                docs.append(json.loads(line[6:]))
        return docs
    finally:
        conn.close()


def free_port() -> int:
    """A loopback port nothing listens on (bound, then closed: connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def server() -> Iterator[ServerThread]:
    with ServerThread(
        options=ServerOptions(token=TOKEN, metrics=MetricsOptions(port=0)), extensions=[ParamServer()]
    ) as thread:
        yield thread


def test_the_stream_sends_snapshots_about_once_a_second(server: ServerThread, tmp_path: Path) -> None:
    token_file = write_token_file(tmp_path / "token", TOKEN)
    with DashboardProcess([server.url], ["--token-file", str(token_file), "--interval", "0.3"]) as dashboard:
        status, headers, page = request(dashboard.url)
        assert status == 200 and "/static/app.js" in page
        assert (
            "script-src" in headers["content-security-policy"]
            or "default-src 'self'" in headers["content-security-policy"]
        )
        for name in ("app.js", "style.css"):
            assert request(dashboard.url + f"static/{name}")[0] == 200
        assert request(dashboard.url + "static/..%2f..%2fcollect.py")[0] == 404
        started = time.monotonic()
        docs = events(dashboard.url, 3)
        assert time.monotonic() - started < 10
        assert docs[0]["t"] < docs[1]["t"] < docs[2]["t"]
        (row,) = docs[-1]["servers"]
        assert row["url"] == server.url and row["up"] and row["role"] == "primary"
        assert row["rates"]["req_s"] is not None  # the dashboard's own STATUS requests, counted


def test_beyond_loopback_the_page_needs_the_token_and_never_sends_it(
    server: ServerThread, tmp_path: Path
) -> None:
    token_file = write_token_file(tmp_path / "token", TOKEN)
    refused = subprocess.run(
        [sys.executable, "-m", "tensorwire.cli", "dashboard", server.url, "--host", "0.0.0.0", "--port", "0"],
        check=False, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert refused.returncode == 2 and "--token-file" in refused.stderr
    certs = write_dev_certs(tmp_path / "certs", ["localhost", "127.0.0.1"], 1)
    CONTEXT["https"] = ssl.create_default_context(cafile=str(certs["ca"]))
    tls = ["--page-tls-cert", str(certs["server"]), "--page-tls-key", str(certs["server_key"])]
    extra = ["--host", "0.0.0.0", "--token-file", str(token_file), "--interval", "0.3", *tls]
    with DashboardProcess([server.url], extra) as dashboard:
        local = dashboard.url.replace("0.0.0.0", "127.0.0.1")
        answers = [request(local), request(local + "events"), request(local + "api/snapshot")]
        assert [a[0] for a in answers] == [303, 401, 401]
        assert answers[0][1]["location"] == "/login"
        login_page = request(local + "login")
        wrong = request(
            local + "login", "POST", "token=guess", **{"Content-Type": "application/x-www-form-urlencoded"}
        )
        assert login_page[0] == 200 and wrong[0] == 403 and "set-cookie" not in wrong[1]
        form = urllib.parse.urlencode({"token": TOKEN})
        ok = request(local + "login", "POST", form, **{"Content-Type": "application/x-www-form-urlencoded"})
        assert ok[0] == 303
        cookie = ok[1]["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
        session = cookie.split(";", 1)[0]
        wait_for(lambda: snapshot(local, Cookie=session).get("servers"), 30, "a snapshot")
        doc = snapshot(local, Cookie=session)
        assert doc["servers"][0]["up"]
        seen = [ok, login_page, wrong, *answers, request(local, Cookie=session)]
        seen += [request(local + f"static/{n}", Cookie=session) for n in ("app.js", "style.css")]
        assert all(TOKEN not in body and TOKEN not in json.dumps(headers) for _, headers, body in seen)
        assert TOKEN not in json.dumps(doc) and TOKEN not in json.dumps(events(local, 1, Cookie=session))
        request(local + "logout", Cookie=session)
        assert request(local + "api/snapshot", Cookie=session)[0] == 401


def test_a_down_server_is_shown_with_its_reason_within_the_timeout(
    server: ServerThread, tmp_path: Path
) -> None:
    token_file = write_token_file(tmp_path / "token", TOKEN)
    gone = f"tcp://127.0.0.1:{free_port()}"
    timeout = 1.0
    extra = ["--token-file", str(token_file), "--timeout", str(timeout), "--interval", "0.3"]
    started = time.monotonic()
    with DashboardProcess([server.url, gone], extra) as dashboard:

        def rows() -> dict[str, Any]:
            return {s["url"]: s for s in snapshot(dashboard.url).get("servers", [])}

        wait_for(lambda: len(rows()) == 2, 3 * timeout + 30, "the first snapshot")  # + the process start
        listed = rows()
        assert listed[server.url]["up"] and not listed[gone]["up"]
        assert "cannot connect" in listed[gone]["error"]
        first = snapshot(dashboard.url)
        assert first["timeline"][0]["kind"] == "down" and first["timeline"][0]["server"] == gone
        # and the page keeps working: later snapshots come, the server that is up stays up
        docs = events(dashboard.url, 2)
        assert all(d["up"] == 1 and d["total"] == 2 for d in docs)
    assert time.monotonic() - started < 60


def test_serve_dashboard_port_serves_the_servers_own_page() -> None:
    with ServerProcess(extra=["--dashboard-port", "0", "--metrics-port", "0"]) as proc:
        wait_for(lambda: "tensorwire dashboard on " in proc.output(), 30, "the page's URL")
        line = next(x for x in proc.output().splitlines() if x.startswith("tensorwire dashboard on "))
        url = line.split(" on ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:")
        wait_for(lambda: snapshot(url).get("servers"), 30, "a snapshot")
        (row,) = snapshot(url)["servers"]
        assert row["url"] == proc.url and row["up"] and row["role"] == "primary"


def test_beyond_loopback_with_a_certificate_the_page_is_https_and_its_cookie_secure(
    server: ServerThread, tmp_path: Path
) -> None:
    certs = write_dev_certs(tmp_path / "certs", ["localhost", "127.0.0.1"], 1)
    token_file = write_token_file(tmp_path / "token", TOKEN)
    tls = ["--page-tls-cert", str(certs["server"]), "--page-tls-key", str(certs["server_key"])]
    extra = ["--host", "0.0.0.0", "--token-file", str(token_file), *tls]
    with DashboardProcess([server.url], extra) as dashboard:
        assert dashboard.url.startswith("https://")
        port = urllib.parse.urlsplit(dashboard.url).port
        context = ssl.create_default_context(cafile=str(certs["ca"]))
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
        try:
            form = urllib.parse.urlencode({"token": TOKEN})
            conn.request(
                "POST", "/login", body=form, headers={"Content-Type": "application/x-www-form-urlencoded"}
            )
            answer = conn.getresponse()
            answer.read()
            cookie = answer.getheader("Set-Cookie") or ""
        finally:
            conn.close()
        assert answer.status == 303 and "Secure" in cookie and "HttpOnly" in cookie and TOKEN not in cookie
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        with pytest.raises((http.client.HTTPException, OSError)):  # no plain http beside it
            plain.request("GET", "/")
            plain.getresponse().read()
        plain.close()


def test_the_page_reaches_mutual_tls_servers_with_the_client_certificate(tmp_path: Path) -> None:
    """--tls-cert/--tls-key are the client's, as on every command, once the page has its own
    (--page-tls-cert/--page-tls-key): the servers that ask for a client certificate are up on the
    page; without one the same server is shown down."""
    certs = write_dev_certs(tmp_path / "certs", ["localhost", "127.0.0.1"], 1)
    CONTEXT["https"] = ssl.create_default_context(cafile=str(certs["ca"]))
    mutual = TlsFiles(certs["server"], certs["server_key"], ca=certs["ca"])
    page = ["--page-tls-cert", str(certs["server"]), "--page-tls-key", str(certs["server_key"])]
    reach = ["--tls-ca", str(certs["ca"]), "--interval", "0.3", "--timeout", "2", *page]
    with ServerThread(["tls://127.0.0.1:0"], ServerOptions(tls=mutual)) as srv:
        mine = ["--tls-cert", str(certs["client"]), "--tls-key", str(certs["client_key"])]
        with DashboardProcess([srv.url], [*reach, *mine]) as dashboard:
            assert dashboard.url.startswith("https://")
            wait_for(lambda: snapshot(dashboard.url).get("servers"), 30, "a snapshot")
            (row,) = snapshot(dashboard.url)["servers"]
            assert row["up"], row
            assert "deprecated" not in "".join(dashboard.lines)
        with DashboardProcess([srv.url], reach) as dashboard:
            wait_for(lambda: snapshot(dashboard.url).get("servers"), 30, "a snapshot")
            (row,) = snapshot(dashboard.url)["servers"]
            assert not row["up"], row
