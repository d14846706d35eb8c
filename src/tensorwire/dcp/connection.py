"""The connection a DCP ``StorageWriter`` and ``StorageReader`` share: the server's url, the client
options, the checkpoint's prefix ``<namespace>/<checkpoint_id>`` (docs/protocol.md §14.8), and the
client opened from them on first use. Its own module because both ``writer.py`` and ``reader.py``
hold one, and so that neither imports the other; with it, the checks of a checkpoint id and the
defaults both sides take.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tensorwire.client import Client, connect
from tensorwire.errors import InvalidTensor, TensorwireError
from tensorwire.security import TlsFiles
from tensorwire.wire.names import validate_name

DEFAULT_NAMESPACE = "dcp"
DEFAULT_TIMEOUT = 120.0  # seconds: one request, and the longest a save's parts wait for each other
FIRST = 1  # the generation a checkpoint is: the first commit under its id


class Connection:
    """The url and options a writer or reader holds, and the client opened from them on first use
    (dropped when pickled: a copy in another process opens its own)."""

    def __init__(
        self,
        url: str,
        checkpoint_id: str | os.PathLike[str],
        *,
        token: str | None,
        tls: TlsFiles | None,
        namespace: str,
        timeout: float,
        options: Mapping[str, Any] | None,
    ) -> None:
        if not 0 < timeout < float("inf"):
            raise InvalidTensor(f"timeout must be a finite number of seconds, not {timeout}")
        self.url = url
        self.namespace = validate_name(namespace)
        self.timeout = timeout
        self._options = {**(options or {}), "token": token, "tls": tls, "timeout": timeout}
        self.checkpoint_id = checked_id(namespace, checkpoint_id)
        self._client: Client | None = None

    @property
    def prefix(self) -> str:
        return f"{self.namespace}/{self.checkpoint_id}"

    def client(self) -> Client:
        if self._client is None:
            self._client = connect(self.url, **self._options)
        return self._client

    def drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        return state


def checked_id(namespace: str, checkpoint_id: str | os.PathLike[str]) -> str:
    given = os.fspath(checkpoint_id)
    if not isinstance(given, str):
        raise InvalidTensor(f"a checkpoint id is a str, not {type(given).__name__}")
    validate_name(f"{namespace}/{given}")  # InvalidName: no empty, '.' or '..' segments
    return given


def valid_id(checkpoint_id: str | os.PathLike[str]) -> bool:
    try:
        checked_id(DEFAULT_NAMESPACE, checkpoint_id)
    except (TensorwireError, TypeError):
        return False
    return True


__all__ = ["DEFAULT_NAMESPACE", "DEFAULT_TIMEOUT", "FIRST", "Connection", "checked_id", "valid_id"]
