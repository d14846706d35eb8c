"""The tensorwire server: a TensorStore served over every listening address.

``Server`` holds the store, the one opcode -> handler table (the store's operations, store_ops.py,
and the extensions', request.py), the listeners (one table by scheme, ``LISTENERS``), the watchdog
that cuts off connections that are unauthenticated too long, stalled or idle, and the metrics.
Each frame-protocol connection is a ``Session`` (session.py). ``ServerThread`` runs a server on a
loop of its own in a background thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from tensorwire import topology, transport
from tensorwire._aio import LoopThread, cancel_and_wait, within
from tensorwire.errors import ConnectionLost, LimitExceeded
from tensorwire.logs import event
from tensorwire.security import TlsFiles, exposure_warning, server_ssl_context
from tensorwire.server import metrics
from tensorwire.server import rdma as server_rdma
from tensorwire.server import shm as server_shm
from tensorwire.server.generation_ops import GenerationOps
from tensorwire.server.options import ServerOptions, from_keywords
from tensorwire.server.request import Attached, Extension, Handler, Request, Started, opname, peer_token_of
from tensorwire.server.session import Serving, Session
from tensorwire.server.store_ops import StoreOps
from tensorwire.store import TensorStore
from tensorwire.store.generations import Generations
from tensorwire.store.uploads import Uploads
from tensorwire.transport import tls
from tensorwire.transport.base import ByteStream, Listener
from tensorwire.types import Address
from tensorwire.wire import meta as wm
from tensorwire.wire import shm as ws

log = logging.getLogger("tensorwire.server")


class Server:
    """Serves one store on any number of addresses (``tcp://host:0`` binds a free port), configured
    by one ``ServerOptions`` (options.py): ``Server(ServerOptions(token=...))``.

    It is a tensor store only: the parameter server (``PS_*`` opcodes, ALLREDUCE, gRPC
    ``GradientService``) is an extension, ``Server(extensions=[ps.ParamServer()])``, which
    ``tensorwire serve`` always adds. Without it, a ``ps.Worker`` gets PROTOCOL_ERROR (unknown
    opcode). It is not a default here on purpose: ``tensorwire.ps`` builds on this module, not the
    other way round. ``store``: the store to serve (default: one built from ``options.store``).
    The keywords it took before ``ServerOptions`` (``security=``, ``stall_timeout=``, ...) still
    work for one release, with a DeprecationWarning (``options.from_keywords``).
    """

    def __init__(
        self,
        options: ServerOptions | None = None,
        *,
        store: TensorStore | None = None,
        extensions: Sequence[Extension] = (),
        **deprecated: Any,
    ) -> None:
        self.options = options = from_keywords(options, deprecated)
        self.store = store if store is not None else options.store.build()
        # Where it runs (HELLO and STATUS say it; default: TENSORWIRE_HOST / _RACK, read now), and
        # which processes may share its segment directory (clients with prefer_local compare it).
        self.location = options.location or topology.here()
        self.host_id = topology.host_identity(ws.shm_dir())
        # Who this store is, for clients that cache by version (HELLO, docs/protocol.md §4.5): a
        # restarted in-memory server counts versions from 1 again, so a version alone names nothing.
        self.store_id = secrets.randbits(64) or 1
        self.limits = options.limits
        # TLS files serve tls:// and grpcs:// addresses; a token is required on every connection.
        self.security = options.security()
        self.peer_token = peer_token_of(extensions)  # opens peer sessions (Replicated)
        _check_secrets(options.metrics.token, self.security.token, self.peer_token)
        self._refusing = 0  # over-limit connections being told so now (see _refuse)
        self._listeners: list[Listener] = []
        self._sessions: set[Session] = set()
        self._cut: set[Session] = set()  # closed by the watchdog, their handlers not yet returned
        # Resumable and striped uploads: a bounded table, a quota per client, none for small puts
        # (uploads.py says how a full table makes room).
        up = options.uploads
        self.uploads = Uploads(self.store, up.max_uploads, options.connections.stall_timeout,
                               per_client=up.per_client, min_bytes=up.resumable_min_bytes)  # fmt: skip
        self._watchdog: asyncio.Task[None] | None = None
        # Metrics (metrics.py): plain counts always; the HTTP endpoint when a port is given.
        self.counts = metrics.RequestCounts()
        self.exporter: metrics.Exporter | None = None
        self._registry: Any = None
        self._started = time.time()
        # The one opcode -> handler table: the store's operations, then each extension's.
        self.handlers: dict[int, Handler] = {}
        store_ops = self._store_ops()
        self._add_handlers(store_ops.frame_handlers(), "the store")
        # Generations (generation_ops.py): a parked wait ends well before its connection looks idle.
        self.generations = Generations(self.store, options.generations)
        max_wait = options.connections.idle_timeout / 2
        self.generation_ops = GenerationOps(self.generations, store_ops, max_wait=max_wait)
        self.part_publishes = self.generation_ops.parts  # SHM_GEN_PART joins its transactions
        self._add_handlers(self.generation_ops.frame_handlers(), "generations")
        self.extensions: list[Extension] = []
        for extension in extensions:
            self.extend(extension)
        self._serving = Serving(
            self.store, self.limits, self.handlers, store_ops.ready_handlers(), self.counts,
            self.security.token, self.peer_token,
        )  # fmt: skip

    def _store_ops(self) -> StoreOps:
        return StoreOps(
            self.store,
            self.limits,
            self.uploads,
            self.counts,
            status=lambda: self.status(),  # noqa: PLW0108 (looked up per request: a subclass may answer otherwise)
            where=self.whereabouts,
            store_id=self.store_id,
            peer_token=self.peer_token,
            stall_timeout=self.options.connections.stall_timeout,
        )

    def extend(self, extension: Extension) -> None:
        """Serve ``extension`` too (``Server(extensions=...)`` calls it; the first shm:// listener
        adds its own while the server starts): its frame handlers join the table, and the server
        closes it when it stops. One that needs the server (``Attached``) is handed it then."""
        self._add_handlers(extension.frame_handlers(), type(extension).__name__)
        self.extensions.append(extension)
        if isinstance(extension, Attached):
            extension.added_to(self)

    def _add_handlers(self, handlers: Mapping[int, Handler], owner: str) -> None:
        taken = sorted(opname(op) for op in handlers if op in self.handlers)
        if taken:
            raise ValueError(f"{owner} serves opcodes the server serves already: {', '.join(taken)}")
        self.handlers.update(handlers)

    @property
    def addresses(self) -> list[Address]:
        return [listener.address for listener in self._listeners]

    def whereabouts(self) -> wm.Whereabouts:
        """Where this server runs and its first shm:// listener, as HELLO tells clients (§4.5)."""
        shm = next((str(a) for a in self.addresses if a.scheme == "shm"), "")
        loc = self.location
        return wm.Whereabouts(loc.host, loc.rack or "", self.host_id, shm)

    async def start(self, *urls: str) -> list[Address]:
        """Listen on every URL: ``tcp://`` and ``memory://`` speak the frame protocol, ``grpc://``
        serves ``TensorService`` (rpc.py); all share this server's store."""
        for url in urls:
            address = Address.parse(url)
            listen = LISTENERS.get(address.scheme)
            if listen is None:
                raise ValueError(f"cannot serve {address}: known schemes are {', '.join(LISTENERS)}")
            listener = await listen(self, address)
            self._listeners.append(listener)
            warning = exposure_warning(address.host, listener.encrypted, bool(self.security.token))
            if warning and listener.networked:
                log.warning("%s: %s", listener.address, warning)  # the port it got
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        served = self.options.metrics
        if served.port is not None and self.exporter is None:
            self.exporter = metrics.Exporter(
                self.registry,
                self._metrics_host(),
                served.port,
                max_connections=served.connections,
                timeout=self.options.connections.auth_timeout,
                scrape_token=served.token,
                # Anyone a server asks for a token or a certificate sees client-chosen labels only as
                # pseudonyms, under a key derived from the token, else the metrics token (metrics.py).
                private=self.security.token is not None or bool(self.security.tls and self.security.tls.ca),
                key=metrics.pseudonym_key(self.security.token, served.token),
            )
        event(log, logging.INFO, "server started", addresses=[str(a) for a in self.addresses],
              metrics=self.exporter.url if self.exporter else None, pid=os.getpid())  # fmt: skip
        for extension in self.extensions:
            if isinstance(extension, Started):
                await extension.started(self)
        return self.addresses

    @property
    def registry(self) -> Any:
        """This server's own ``prometheus_client.CollectorRegistry`` (built when first asked for)."""
        if self._registry is None:
            extra = [c for e in self.extensions if isinstance(e, metrics.Observed) for c in e.collectors()]
            self._registry = metrics.build_registry(self, extra)
        return self._registry

    def _metrics_host(self) -> str:
        """Where metrics are served: --metrics-host, else the host of the first network address."""
        if self.options.metrics.host:
            return self.options.metrics.host
        hosts = [a.host for a in self.addresses if a.scheme != "memory"]
        return hosts[0] if hosts else "127.0.0.1"

    def status(self) -> dict[str, Any]:
        """What the STATUS request answers (docs/protocol.md §11.9; ``tensorwire status`` shows it)."""
        store, counts = self.store, self.counts
        doc: dict[str, Any] = {
            "version": metrics.package_version(),
            "pid": os.getpid(),
            "uptime_s": time.time() - self._started,
            "addresses": [str(a) for a in self.addresses],
            "host": self.location.host,
            "rack": self.location.rack,
            "metrics": self.exporter.url if self.exporter else None,
            "metrics_key": self.exporter.key if self.exporter else None,  # to map its pseudonyms back
            "store": {
                "tensors": len(store),
                "bytes": store.stored,
                "reserved": store.reserved,
                "capacity": store.capacity,
                "used": store.used,  # what counts against the capacity: all of the below
                "metadata": store.metadata,
                "pinned": store.pinned,
                "scratch": store.scratch_bytes,
                "charged": store.charged,  # what other parts of the process hold, by kind (ps.*, exchange)
                "max_tensors": store.max_tensors,
                "uploads": len(self.uploads),
            },
            "connections": counts.connections,
            "in_flight": counts.in_flight,
            "requests": sum(row.requests for row in list(counts.rows.values())),
            **self.generation_ops.status(),
        }
        for extension in self.extensions:
            if isinstance(extension, metrics.Observed):
                doc.update(extension.status())
        return doc

    async def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        for listener in listeners:
            await listener.close()
        await cancel_and_wait(self._watchdog)
        self._watchdog = None
        for extension in self.extensions:
            await extension.close()
        self.uploads.close()
        self.generations.close()
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        event(log, logging.INFO, "server stopped", pid=os.getpid())

    async def _watch(self) -> None:
        """Cut off sessions not admitted in time (``auth_timeout``), stalled mid-request
        (``stall_timeout``) or idle (``idle_timeout``): ``options.connections``."""
        limits = self.options.connections
        period = max(min(limits.stall_timeout, limits.idle_timeout, limits.auth_timeout, 20.0) / 4, 0.01)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            self.uploads.expire(now)
            for session in list(self._sessions):
                # One connection's failure to close must not end the watchdog: every later
                # connection would then keep its slot for ever.
                try:
                    await self._check(session, now)
                except Exception:
                    log.exception("the watchdog could not close %s", session.stream.peer)

    async def _check(self, session: Session, now: float) -> None:
        if session in self._cut:  # closed once already (its handler is still finishing): not again
            return
        quiet = now - session.stream.last_active
        limits = self.options.connections
        if not session.admitted and now - session.opened > limits.auth_timeout:
            self._cut.add(session)
            await self._close_unadmitted(session)
        elif session.busy and quiet > limits.stall_timeout:
            self._cut.add(session)
            log.warning("closing %s: no progress for %.3gs mid-request", session.stream.peer, quiet)
            await session.stream.close()
        elif not session.busy and quiet > limits.idle_timeout:
            self._cut.add(session)
            log.info("closing %s: idle for %.3gs", session.stream.peer, quiet)
            await session.stream.close()

    async def _close_unadmitted(self, session: Session) -> None:
        """A connection did not finish its TLS handshake and send its first frame (authenticated,
        when a token is required) within ``auth_timeout``: its slot goes to someone else."""
        self.counts.refuse("auth_timeout")
        reason = f"not authenticated within {self.options.connections.auth_timeout:.3g}s (--auth-timeout)"
        event(log, logging.WARNING, "connection closed", peer=session.stream.peer, reason=reason)
        await session.stream.close()

    async def _refuse(self, stream: ByteStream, transport: str) -> None:
        """A connection over ``max_connections``: answered LimitExceeded while fewer than
        ``refusals`` others are being answered, else closed at once (by the listener, when this
        returns). An answer may take a while (over TLS it needs the peer's handshake first; a
        silent peer holds it until auth_timeout), and each one holds a descriptor meanwhile: a
        flood of silent sockets must not hold one each, or the process runs out of descriptors
        and its other clients' persisted puts fail (EMFILE). Refusing at once rather than pausing
        the accept loop keeps the listen backlog moving: a client learns at once that it must try
        later, instead of waiting in the backlog behind the flood."""
        limits = self.options.connections
        answered = self._refusing < limits.refusals
        self.counts.refuse("limit")
        event(log, logging.WARNING, "connection refused", peer=stream.peer, reason="limit",
              connections=len(self._sessions), answered=answered)  # fmt: skip
        if not answered:
            return
        self._refusing += 1
        try:
            refusal = LimitExceeded(
                f"the server has {limits.max_connections} connections already (--max-connections)"
            )
            session = Session(self._serving, stream, transport)
            # Within the auth deadline: over TLS the answer needs the peer's handshake first.
            with contextlib.suppress(TimeoutError):
                await within(session.send_error(0, refusal), limits.auth_timeout)
        finally:
            self._refusing -= 1

    async def handle(self, stream: ByteStream, transport: str = "tcp") -> None:
        """Serve one connection until the peer leaves or its bytes stop making frames."""
        if len(self._sessions) >= self.options.connections.max_connections:
            await self._refuse(stream, transport)
            return
        session = Session(self._serving, stream, transport)
        self._sessions.add(session)
        self.counts.connections += 1
        stream.busy_poll(self.options.connections.busy_poll)
        try:
            await session.run()
        except ConnectionLost as exc:
            log.debug("session with %s ended: %s", stream.peer, exc)
        except Exception:
            log.exception("session with %s failed", stream.peer)
        finally:
            self.counts.connections -= 1
            self._sessions.discard(session)
            self._cut.discard(session)
            session.close()


def _check_secrets(metrics_token: str | None, token: str | None, peer_token: str | None) -> None:
    """Each secret a server holds opens something else: none may be another's (or empty)."""
    if peer_token is not None and peer_token == token:
        raise ValueError("the peer token must differ from the clients' token: any client could replicate")
    if metrics_token is not None and metrics_token in ("", token, peer_token):
        raise ValueError("the metrics token must be another secret than the clients' and the peer token")


async def _listen_frames(server: Server, address: Address) -> Listener:
    if address.scheme == "tls":
        context = server_ssl_context(_tls_files(server, address))
        return await tls.listen(address, functools.partial(server.handle, transport="tls"), context)
    return await transport.listen(address, functools.partial(server.handle, transport=address.scheme))


async def _listen_rpc(server: Server, address: Address) -> Listener:
    from tensorwire.server import rpc as server_rpc  # grpcio loads only when gRPC is served

    files = _tls_files(server, address) if address.scheme == "grpcs" else None
    limits = server.options.connections
    return await server_rpc.listen(
        address,
        server.store,
        server.limits,
        tls=files,
        token=server.security.token,
        stall_timeout=limits.stall_timeout,
        extra_handlers=[h for extension in server.extensions for h in extension.rpc_handlers()],
        counts=server.counts,
        max_connections=limits.max_connections,
        auth_timeout=limits.auth_timeout,
        idle_timeout=limits.idle_timeout,
        generations=server.generation_ops,
    )


def _tls_files(server: Server, address: Address) -> TlsFiles:
    files = server.security.tls
    if files is None or files.cert is None or files.key is None:
        raise ValueError(f"serving {address} needs a TLS certificate and key (--tls-cert, --tls-key)")
    return files


async def _listen_shm(server: Server, address: Address) -> Listener:
    return await server_shm.listen(server, address)  # the first one adds the ShmService extension


async def _listen_rdma(server: Server, address: Address) -> Listener:
    """rdma:// (control on TCP) or rdmas:// (control inside TLS); the first adds the RdmaService."""
    context = server_ssl_context(_tls_files(server, address)) if address.scheme == "rdmas" else None
    return await server_rdma.listen(server, address, context)


# The server's table of listeners, by scheme (the clients' table is tensorwire.transport.TRANSPORTS).
LISTENERS: dict[str, Callable[[Server, Address], Awaitable[Listener]]] = {
    "tcp": _listen_frames,
    "memory": _listen_frames,
    "tls": _listen_frames,
    "grpc": _listen_rpc,
    "grpcs": _listen_rpc,
    "shm": _listen_shm,
    "rdma": _listen_rdma,
    "rdmas": _listen_rdma,
}


class ServerThread:
    """A server running on its own event loop in a background thread (tests, embedding, demo).

    ``with ServerThread(["tcp://127.0.0.1:0"]) as srv: connect(srv.url)``; ``options``,
    ``store`` and ``extensions`` are ``Server``'s.

    Like ``Server``, it is a tensor store only; a parameter server (what ``tensorwire serve`` runs)
    needs the extension: ``ServerThread(extensions=[ps.ParamServer()])``. The constructor returns
    once the server listens (``url``, ``addresses``); an error starting it is raised there, and
    TimeoutError if it has not started within ``start_timeout`` seconds.
    """

    def __init__(
        self,
        urls: Sequence[str] = ("tcp://127.0.0.1:0",),
        options: ServerOptions | None = None,
        *,
        store: TensorStore | None = None,
        extensions: Sequence[Extension] = (),
        start_timeout: float = 10.0,
        **deprecated: Any,  # Server's old keywords (options.from_keywords)
    ) -> None:
        self.server = Server(from_keywords(options, deprecated), store=store, extensions=extensions)
        self._thread = LoopThread("tensorwire-server")
        self._closed = False
        started = self._thread.submit(self.server.start(*urls))
        try:
            started.result(start_timeout)
        except BaseException:
            if not started.done():
                raise TimeoutError(f"server did not start within {start_timeout}s") from None
            self._closed = True
            self._thread.stop()
            raise

    @property
    def addresses(self) -> list[Address]:
        return self.server.addresses

    @property
    def url(self) -> str:
        return str(self.addresses[0])

    def close(self, timeout: float = 10.0) -> None:
        """Stop the server (its listeners, extensions, exporter), then its loop; waits at most about
        ``timeout`` seconds for the server to close."""
        if self._closed:
            return
        self._closed = True
        closing = self._thread.submit(self.server.close())
        done, _ = concurrent.futures.wait([closing], timeout)
        error = closing.exception() if done and not closing.cancelled() else None
        if error is not None:
            log.error("closing the server failed", exc_info=error)
        self._thread.stop()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ``Extension``, ``Handler`` and ``Request`` live in request.py; ``tensorwire.server`` exports them.
__all__ = ["LISTENERS", "Extension", "Handler", "Request", "Server", "ServerOptions", "ServerThread"]
