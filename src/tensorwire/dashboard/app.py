"""The dashboard's web app (aiohttp): the page, its static files, and a live stream of snapshots.

Routes: ``/`` the page, ``/static/<file>`` its script and style (package data, no build step, no
CDN), ``/events`` a server-sent-events stream (one ``snapshot`` event per collection, about once a
second), ``/api/snapshot`` the latest document as JSON, ``/login`` and ``/logout``.

Lifecycle: ``Dashboard(source, ...)``; ``await dashboard.start()`` binds (port 0: a free one,
then ``dashboard.port``) and starts collecting every ``interval`` s; ``await dashboard.close()``
stops both. ``source`` is an async callable returning one ``collect.Node`` per server: probes
over the network (``tensorwire dashboard``) or a server's own state (``serve --dashboard-port``).

Security: the page binds 127.0.0.1 unless told otherwise, and answers there only requests whose
``Host`` names this machine (localhost, 127.0.0.1, ::1, the bound address, ``allowed_hosts``): a
site elsewhere that points its own name at 127.0.0.1 (DNS rebinding) is refused. Beyond loopback
it needs the servers' token (``token``) and a certificate (``ssl_context``: it refuses to start on
plain HTTP there, where the token would cross the network in the clear); with a client CA in the
context it asks for client certificates, as the servers do. A browser logs in by posting the token
to ``/login``, which compares it in constant time and sets an HttpOnly, Secure, SameSite=Strict
cookie holding a random session id kept here (never the token, which is never sent to a browser);
login attempts are throttled per client address, and failed ones in all (``guard.LoginThrottle``;
a browser with a valid session is never throttled). Every answer
carries a Content-Security-Policy that allows only this origin's script and style; the page sets
server-sent strings as text, never as markup.

Bounds (``guard.Limits``): connections open at once, in all and per client address (TLS handshakes
included; ``listen.Listener``),
idle connections closed after ``idle_timeout``, a request body within ``read_timeout``, event
streams in all and per client address, and a stream whose reader does not take an event within
``write_timeout`` is dropped (a slow reader holds one event, never a growing queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from importlib import resources
from typing import Any

from aiohttp import web

from tensorwire._aio import within
from tensorwire.dashboard.collect import Node
from tensorwire.dashboard.guard import HostCheck, Limits, LoginThrottle, StreamSlots, client_key, retry_after
from tensorwire.dashboard.listen import Listener
from tensorwire.dashboard.view import View
from tensorwire.security import is_loopback, tokens_match

log = logging.getLogger("tensorwire.dashboard")

DEFAULT_PORT = 8265
DEFAULT_HOST = "127.0.0.1"
DEFAULT_INTERVAL = 1.0
COOKIE = "tw_session"
MAX_SESSIONS = 1024  # logged-in browsers remembered; the oldest is forgotten beyond it
SESSION_SECONDS = 12 * 3600  # a login lasts a working day, then the token is asked again
HEARTBEAT = 15.0  # an event stream with nothing new sends a comment this often: a reader that left is found
STATIC = {"app.js": "text/javascript", "style.css": "text/css", "index.html": "text/html",
          "login.html": "text/html"}  # fmt: skip
HEADERS = {
    # Only this origin's script and style, no inline code, no framing (clickjacking).
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
Source = Callable[[], Awaitable[Sequence[Node]]]


def _redirect(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


def _static(name: str) -> bytes:
    return resources.files("tensorwire.dashboard").joinpath("static", name).read_bytes()


class Dashboard:
    """The web app and its collection loop (the module doc has the lifecycle)."""

    def __init__(
        self,
        source: Source,
        slots: list[list[str]],
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        interval: float = DEFAULT_INTERVAL,
        allowed_hosts: Sequence[str] = (),
        limits: Limits | None = None,
    ) -> None:
        check_exposure(host, token, ssl_context)
        self.source, self.host, self.port = source, host, port
        self.token = token if not is_loopback(host) else None  # loopback: no login asked
        self.ssl_context, self.interval = ssl_context, interval
        self.limits = limits or Limits()
        self.hosts = HostCheck(host, allowed_hosts, login=self.token is not None)
        self.throttle = LoginThrottle(self.limits)
        self.streams = StreamSlots(self.limits)
        self.view = View(slots)
        self.latest: dict[str, Any] | None = None
        self._changed = asyncio.Condition()
        self._sessions: dict[str, float] = {}
        self._runner: web.AppRunner | None = None
        self._listener: Listener | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> int:
        """Bind and start collecting; the port it got."""
        # shutdown_timeout: an open event stream is cut after 1 s at close (it never ends by itself);
        # keepalive_timeout: a connection with no request (from its start, or since its last) is closed.
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, shutdown_timeout=1.0,
                               keepalive_timeout=self.limits.idle_timeout)  # fmt: skip
        await runner.setup()
        self._runner = runner
        assert runner.server is not None  # made by setup()
        listener = Listener(runner.server, self.host, self.port, self.ssl_context, self.limits)
        try:
            self.port = await listener.start()
        except BaseException:
            await self.close()
            raise
        self._listener = listener
        self._task = asyncio.get_running_loop().create_task(self._collect_forever())
        return self.port

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/"

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- collecting ------------------------------------------------------------------------------
    async def _collect_forever(self) -> None:
        """Every ``interval`` s a snapshot; a collection that fails is logged, never fatal (the
        probes themselves never raise for a server that is down: that is a row saying why)."""
        while True:
            started = time.monotonic()
            try:
                nodes = await self.source()
                await self.publish(self.view.update(nodes, time.time()))
            except Exception:
                log.exception("dashboard collection failed")
            await asyncio.sleep(max(self.interval - (time.monotonic() - started), 0.05))

    async def publish(self, doc: dict[str, Any]) -> None:
        async with self._changed:
            self.latest = doc
            self._changed.notify_all()

    # -- the web app -----------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=4096)
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._file)
        app.router.add_get("/events", self._events)
        app.router.add_get("/api/snapshot", self._snapshot)
        app.router.add_get("/login", self._login_page)
        app.router.add_post("/login", self._login)
        app.router.add_get("/logout", self._logout)
        app.router.add_get("/favicon.ico", self._no_icon)  # a browser asks; a 404 is a console error
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Security headers on every answer; a Host this page does not go by is refused (DNS
        rebinding); beyond loopback, a login before anything but it."""
        open_paths = ("/login", "/static/style.css", "/favicon.ico")
        response: web.StreamResponse
        if not self.hosts.allows(request.headers.get("Host")):
            response = web.Response(status=403, text="this page does not answer to that Host name "
                                    "(--allowed-host adds one)\n")  # fmt: skip
        elif self.token is not None and request.path not in open_paths and not self._logged_in(request):
            if request.path == "/":
                response = _redirect("/login")
            else:
                response = web.Response(status=401, text="log in first: /login\n")
        else:
            try:
                response = await handler(request)
            except web.HTTPException as exc:
                response = exc
        response.headers.update(HEADERS)
        return response

    def _logged_in(self, request: web.Request) -> bool:
        started = self._sessions.get(request.cookies.get(COOKIE, ""))
        return started is not None and time.monotonic() - started < SESSION_SECONDS

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(body=_static("index.html"), content_type="text/html")

    async def _file(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        return web.Response(body=_static(name), content_type=STATIC[name])

    async def _no_icon(self, request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def _snapshot(self, request: web.Request) -> web.Response:
        return web.json_response(self.latest or {})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: the latest snapshot now, then each new one as it is made; at most
        ``Limits.max_streams`` streams (``streams_per_client`` per client address), and a reader
        that does not take an event within ``write_timeout`` is dropped."""
        client = client_key(request.remote)
        refused = self.streams.take(client)
        if refused is not None:
            return web.Response(status=429, text=f"{refused}\n", headers={"Retry-After": "5"})
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **HEADERS})
            await response.prepare(request)
            await self._stream(request, response)
            return response
        finally:
            self.streams.give(client)

    async def _stream(self, request: web.Request, response: web.StreamResponse) -> None:
        async for doc in self._snapshots():
            event = (
                b": still here\n\n"
                if doc is None
                else f"event: snapshot\ndata: {json.dumps(doc)}\n\n".encode()
            )
            try:
                await within(response.write(event), self.limits.write_timeout)
            except ConnectionResetError:  # the browser went away
                return
            except TimeoutError:
                log.info("dropping the event stream of %s: it took no event for %.3gs", request.remote,
                         self.limits.write_timeout)  # fmt: skip
                if request.transport is not None:
                    request.transport.abort()  # what it did not read is thrown away with it
                return

    async def _snapshots(self) -> AsyncIterator[dict[str, Any] | None]:
        """The latest document, then each newer one (a slow reader skips to the newest); None
        after ``HEARTBEAT`` s with nothing new."""
        sent: list[dict[str, Any] | None] = [None]
        while True:
            async with self._changed:
                try:
                    await within(
                        self._changed.wait_for(
                            lambda: self.latest is not None and self.latest is not sent[0]
                        ),
                        HEARTBEAT,
                    )
                except TimeoutError:
                    yield None
                    continue
                doc = sent[0] = self.latest
            yield doc

    async def _login_page(self, request: web.Request) -> web.Response:
        if self.token is None:
            return _redirect("/")
        return web.Response(body=_static("login.html"), content_type="text/html")

    async def _login(self, request: web.Request) -> web.Response:
        if self.token is None or self._logged_in(request):  # a valid session: nothing to throttle
            return _redirect("/")
        client = client_key(request.remote)
        wait = self.throttle.admit(client)
        if wait:
            return web.Response(status=429, text="too many login attempts; wait\n",
                                headers={"Retry-After": retry_after(wait)})  # fmt: skip
        try:
            form = await within(request.post(), self.limits.read_timeout)
        except TimeoutError:
            return web.Response(status=408, text="the login form did not arrive in time\n")
        offered = form.get("token")
        if not tokens_match(self.token, offered if isinstance(offered, str) else None):
            self.throttle.failed(client)
            return web.Response(status=403, text="wrong token\n")
        self.throttle.succeeded(client)
        session = secrets.token_urlsafe(32)
        self._forget_expired()
        self._sessions[session] = time.monotonic()
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.pop(next(iter(self._sessions)))
        response = _redirect("/")
        # Secure: a page with a login is served over HTTPS only (check_exposure), so is its cookie.
        response.set_cookie(COOKIE, session, httponly=True, samesite="Strict", secure=True, path="/",
                            max_age=SESSION_SECONDS)  # fmt: skip
        return response

    def _forget_expired(self) -> None:
        now = time.monotonic()
        for session, started in list(self._sessions.items()):
            if now - started >= SESSION_SECONDS:
                del self._sessions[session]

    async def _logout(self, request: web.Request) -> web.Response:
        self._sessions.pop(request.cookies.get(COOKIE, ""), None)
        response = _redirect("/login" if self.token else "/")
        response.del_cookie(COOKIE, path="/")
        return response


def check_exposure(host: str, token: str | None, ssl_context: ssl.SSLContext | None) -> None:
    """ValueError unless a page bound to ``host`` is private: on loopback, or with the servers'
    token and TLS (a login over plain HTTP would send the token across the network in the clear)."""
    if is_loopback(host):
        return
    where = repr(host) if host else "every interface"
    if not token:  # a bad argument, as for any constructor: the CLI checks it first
        raise ValueError(f"the dashboard on {where} is reachable beyond loopback: give it the servers' "
                         "token (--token-file), which a browser must enter to see the page")  # fmt: skip
    if ssl_context is None:
        raise ValueError(f"the dashboard on {where} is reachable beyond loopback: give it a certificate "
                         "(dashboard --page-tls-cert/--page-tls-key, serve --tls-cert/--tls-key); the login "
                         "would send the token in the clear over plain HTTP")  # fmt: skip


__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "Dashboard", "Limits", "Source", "check_exposure"]
