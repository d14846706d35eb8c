"""Where the dashboard's snapshots come from: probes of servers over the network
(``tensorwire dashboard URL...``), or a server's own state (``tensorwire serve --dashboard-port``).

Each source is an async callable returning one ``collect.Node`` per server; none raises for a
server that is down (its node says why).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from tensorwire._aio import within
from tensorwire.client.core import ClientOptions
from tensorwire.dashboard.collect import Node, probe_all, take_key
from tensorwire.server import metrics


def network(urls: Sequence[str], timeout: float, **client: Any) -> Callable[[], Awaitable[list[Node]]]:
    """Probe ``urls`` (each within ``collect.DEADLINE_FACTOR`` x ``timeout``) at every call;
    ``client`` are ClientOptions fields (tls, token)."""
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


def local(server: Observed, timeout: float = 10.0) -> Callable[[], Awaitable[list[Node]]]:
    """The server's own STATUS and metrics, read in its process (no token or TLS to go through).
    Made on the server's event loop; called from the page's own (``listen.PageThread``), the
    STATUS is read on the server's loop, which owns that state (within ``timeout``), and the
    metrics are rendered on a worker thread, as the exporter does: the page costs the serving
    loop one STATUS read per snapshot, whatever its readers do."""
    from prometheus_client import generate_latest

    home = asyncio.get_running_loop()

    async def status() -> dict[str, Any]:
        return server.status()

    known = str(server.addresses[0]) if server.addresses else "local"  # a stopped server has none

    async def snapshot() -> list[Node]:
        url = str(server.addresses[0]) if server.addresses else known
        if asyncio.get_running_loop() is home:
            doc = server.status()
        else:
            ask = status()
            try:
                asked = asyncio.run_coroutine_threadsafe(ask, home)
            except RuntimeError:  # the server's loop is closed: a row says so (the module's rule)
                ask.close()
                return [Node(url, error="the server has stopped")]
            try:
                doc = await within(asyncio.wrap_future(asked), timeout)
            except TimeoutError:
                return [Node(url, error=f"the server's event loop did not answer STATUS within {timeout}s")]
        page = await asyncio.to_thread(generate_latest, server.registry)  # in full: no pseudonyms here
        doc = dict(doc)
        take_key(doc)  # not for the page to show
        return [Node(url, status=doc, samples=metrics.parse(page.decode()))]

    return snapshot


__all__ = ["Observed", "local", "network"]
