"""The user-facing clients: ``AsyncClient`` (``await tensorwire.aconnect(url)``, async_client.py) and
``Client`` (``tensorwire.connect(url)``, blocking.py), with the same operations and the same
``ClientOptions`` (options.py). Calls are retried by ``client/retry.py``; what a call's path is
(striped, staged, resumable) is asked of the transport (``transport/base.py``)."""

from __future__ import annotations

import warnings
from typing import Any

from tensorwire.client.async_client import AsyncClient
from tensorwire.client.blocking import Client
from tensorwire.client.options import CHECKSUMS, DEPRECATED_TLS, ClientOptions, legacy_tls

_LEGACY_TLS = ("tls_ca", "tls_cert", "tls_key")


def _options(kwargs: dict[str, Any]) -> ClientOptions | None:
    """``ClientOptions(**kwargs)``; the deprecated TLS keywords become ``tls=`` here, with the warning
    pointing at the caller of ``connect``/``aconnect``."""
    if not kwargs:
        return None
    legacy = [kwargs.pop(name, None) for name in _LEGACY_TLS]
    files = legacy_tls(*legacy)
    if files is not None:
        warnings.warn(DEPRECATED_TLS, DeprecationWarning, stacklevel=3)
        if kwargs.get("tls") not in (None, files):
            raise ValueError("give tls= or the deprecated tls_ca=/tls_cert=/tls_key=, not both")
        kwargs["tls"] = files
    return ClientOptions(**kwargs)


def connect(url: str, **options: Any) -> Client:
    """A blocking client of the server at ``url`` (``tcp://host:port``, ``shm://127.0.0.1:port``, ...),
    connected now so that a wrong address fails here. ``options`` are ``ClientOptions`` fields:
    ``connect(url, tls=TlsFiles(ca=...), token=...)``."""
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
