"""Where the dashboard's snapshots come from: probes of servers over the network
(``tensorwire dashboard URL...``), or a server's own state (``tensorwire serve --dashboard-port``).

Each source is an async callable returning one ``collect.Node`` per server; none raises for a
server that is down (its node says why).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from tensorwire.client.core import ClientOptions
from tensorwire.dashboard.collect import Node, probe_all
from tensorwire.server import metrics


def network(urls: Sequence[str], timeout: float, **client: Any) -> Callable[[], Awaitable[list[Node]]]:
    """Probe ``urls`` (each within ``collect.DEADLINE_FACTOR`` x ``timeout``) at every call;
    ``client`` are ClientOptions (tls_ca, token)."""
    options = ClientOptions(timeout=timeout, connect_timeout=timeout, **client)

    async def snapshot() -> list[Node]:
        return await probe_all(urls, options)

    return snapshot


class Observed(Protocol):
    """What the dashboard reads of a server in its own process (``server.core.Server`` is one)."""

    def status(self) -> dict[str, Any]: ...

    @property
    def registry(self) -> Any: ...

    @property
    def addresses(self) -> Sequence[Any]: ...


def local(server: Observed) -> Callable[[], Awaitable[list[Node]]]:
    """The server's own STATUS and metrics, read in its process (no token or TLS to go through).
    The metrics are rendered on a worker thread, as the exporter does, off the serving loop."""
    from prometheus_client import generate_latest

    async def snapshot() -> list[Node]:
        url = str(server.addresses[0]) if server.addresses else "local"
        page = await asyncio.to_thread(generate_latest, server.registry)
        return [Node(url, status=server.status(), samples=metrics.parse(page.decode()))]

    return snapshot


__all__ = ["Observed", "local", "network"]
