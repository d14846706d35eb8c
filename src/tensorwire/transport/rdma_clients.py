"""This process's client engines (``client_engine``), shared by every rdma:// connection from it.

A client engine registers the caller's buffers for its transfers (``rdma_engine.Registrations``),
which is what costs, so one engine per local address serves every connection from this process
(transport/rdma.py asks for one at RDMA_ATTACH and lets it go at close). The engine names a peer
only ``host:port`` and keeps what it learned of it by that name, so when a server's engine turns
out to be another one under a name the current engine reached before (the server restarted and
its new engine drew the old one's port), a fresh engine becomes current for that address, and the
old one is closed once its last connection lets it go.
"""

from __future__ import annotations

import logging
import threading

from tensorwire.transport.rdma_engine import Engine, requested_protocol

log = logging.getLogger("tensorwire.rdma")


class ClientEngines:
    """This process's client engines, one current per local address, shared by every connection
    from it (registration is what costs). A connection asks for the engine that may reach the
    server's engine by its name; when the current one has reached another engine by that name
    (the server restarted and its new engine drew the old one's port), a fresh engine becomes
    current and the old one is closed once its last connection lets it go."""

    def __init__(self) -> None:
        self._current: dict[str, Engine] = {}  # local address -> the engine new connections get
        self._users: dict[Engine, int] = {}
        self._lock = threading.Lock()

    def acquire(self, host: str, session: str, instance: int, protocol: str) -> Engine:
        with self._lock:
            engine = self._current.get(host)
            if engine is not None and (engine.protocol != protocol or not engine.claim(session, instance)):
                if engine.protocol == protocol:
                    log.warning(
                        "the engine at %s is not the one this process reached by that name before "
                        "(it restarted): a fresh client engine reaches it",
                        session,
                    )
                del self._current[host]
                self._close_if_unused(engine)
                engine = None
            if engine is None:
                # A client engine in TCP mode registers nothing (Registrations): nothing to warn of.
                engine = self._current[host] = Engine(host, protocol, exposes=protocol != "tcp")
                engine.claim(session, instance)
            self._users[engine] = self._users.get(engine, 0) + 1
            return engine

    def current(self, host: str) -> Engine | None:
        """The engine the next connection from ``host`` gets, unless its server's engine is new."""
        with self._lock:
            return self._current.get(host)

    def release(self, engine: Engine) -> None:
        with self._lock:
            self._users[engine] -= 1
            if self._current.get(engine.host) is not engine:
                self._close_if_unused(engine)

    def _close_if_unused(self, engine: Engine) -> None:
        if not self._users.get(engine):
            self._users.pop(engine, None)
            engine.close()


client_engines = ClientEngines()  # this process's


def client_engine(host: str, session: str, instance: int, protocol: str | None = None) -> Engine:
    """A client engine at the local address ``host`` that may reach the peer engine ``instance``
    by its name ``session`` (``protocol`` defaults to ``TENSORWIRE_RDMA_PROTOCOL``); the caller
    holds it until ``release_client_engine``."""
    return client_engines.acquire(host, session, instance, protocol or requested_protocol())


def release_client_engine(engine: Engine) -> None:
    """The caller of ``client_engine`` is done with ``engine`` (closed if it is no longer current)."""
    client_engines.release(engine)
