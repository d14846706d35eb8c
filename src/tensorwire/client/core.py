"""The user-facing clients: ``AsyncClient`` (``await tensorwire.aconnect(url)``, async_client.py) and
``Client`` (``tensorwire.connect(url)``, blocking.py), with the same operations and the same
``ClientOptions`` (options.py). Calls are retried by ``client/retry.py``; what a call's path is
(striped, staged, resumable) is asked of the transport (``transport/base.py``)."""

from __future__ import annotations

from typing import Any

from tensorwire.client.async_client import AsyncClient
from tensorwire.client.blocking import Client
from tensorwire.client.options import CHECKSUMS, ClientOptions


def _options(kwargs: dict[str, Any]) -> ClientOptions | None:
    return ClientOptions(**kwargs) if kwargs else None


def connect(url: str, **options: Any) -> Client:
    """A blocking client of the server at ``url`` (``tcp://host:port``, ``shm://127.0.0.1:port``, ...),
    connected now so that a wrong address fails here. ``options`` are ``ClientOptions`` fields."""
    client = Client(url, _options(options))
    try:
        return client.connect()
    except BaseException:
        client.close()
        raise


async def aconnect(url: str, **options: Any) -> AsyncClient:
    """An asyncio client of the server at ``url``, connected now."""
    client = AsyncClient(url, _options(options))
    try:
        return await client.connect()
    except BaseException:
        await client.close()
        raise


__all__ = ["CHECKSUMS", "AsyncClient", "Client", "ClientOptions", "aconnect", "connect"]
