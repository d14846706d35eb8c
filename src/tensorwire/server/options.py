"""``ServerOptions``: everything a ``Server`` is configured with, as one frozen value (the server's
``ClientOptions``). ``tensorwire serve`` builds one from its flags, ``ServerThread`` and the tests
build one in Python, and ``Server(options)`` reads it; nothing else configures a server.

The options come in groups, each a frozen dataclass whose defaults are the server's:

* ``store``: the store a server builds when none is handed to it (capacity, data directory);
* ``connections``: how many connections, and how long each may be silent, stalled or idle;
* ``uploads``: the table of resumable and striped uploads;
* ``metrics``: the Prometheus endpoint and its read-only secret;
* ``limits`` (request sizes, ``tensorwire.types.Limits``) and ``generations``
  (``GenerationConfig``), which are their own modules' values;
* ``tls`` (a ``TlsFiles``, the one way to say TLS on both sides) and ``token``.

A group checks its own values when it is built (ValueError naming the field); what involves
several parties (the metrics token against the peer token of an extension) is checked by the server.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorwire import topology
from tensorwire.security import Security, TlsFiles
from tensorwire.store import TensorStore
from tensorwire.store.generations import GenerationConfig
from tensorwire.store.memory import DEFAULT_MAX_TENSORS
from tensorwire.store.uploads import (
    DEFAULT_MAX_UPLOADS,
    DEFAULT_RESUMABLE_MIN_BYTES,
    DEFAULT_UPLOADS_PER_CLIENT,
)
from tensorwire.transport.spin import MAX_SPIN
from tensorwire.types import GiB, Limits

# Connections over --max-connections told why at once (the rest are closed unanswered): see
# Server._refuse.
DEFAULT_REFUSALS = 16


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """The store a server builds when it is handed none (``--capacity``, ``--data-dir``,
    ``--max-tensors``); the defaults are ``TensorStore()``'s."""

    capacity: int = 8 * GiB
    data_dir: Path | None = None  # keep tensors on disk here (durable across restarts)
    max_tensors: int = DEFAULT_MAX_TENSORS

    def build(self) -> TensorStore:
        return TensorStore(self.capacity, self.data_dir, max_tensors=self.max_tensors)


@dataclass(frozen=True, slots=True)
class ConnectionOptions:
    """How many connections a server holds and how long each may take (``--max-connections``,
    ``--stall-timeout``, ``--idle-timeout``, ``--auth-timeout``, ``--busy-poll``)."""

    # Each connection holds a session and its read buffer: bound how many.
    max_connections: int = 1024
    # A connection over max_connections is told why (LimitExceeded) while fewer than ``refusals``
    # others are being told, each for at most auth_timeout; beyond that it is closed unanswered.
    refusals: int = DEFAULT_REFUSALS
    # A peer that stops sending or reading in the middle of a request is cut off after this many
    # seconds without progress, and what it reserved is freed.
    stall_timeout: float = 60.0
    # Connections idle this long are closed (a client reconnects on its next call unnoticed).
    idle_timeout: float = 900.0
    # A connection's TLS handshake and first frame (its HELLO with the token) must be in by then.
    auth_timeout: float = 5.0
    # After each request a connection's wait for the next one keeps the loop polling this long
    # before it sleeps (transport/spin.py). It costs CPU; off by default.
    busy_poll: float = 0.0

    def __post_init__(self) -> None:
        if self.refusals < 0:
            raise ValueError(f"refusals must be 0 or more, not {self.refusals!r}")
        if not 0 <= self.busy_poll <= MAX_SPIN:
            raise ValueError(f"busy_poll must be 0 to {MAX_SPIN} seconds, not {self.busy_poll!r}")


@dataclass(frozen=True, slots=True)
class UploadOptions:
    """Resumable and striped uploads (``store/uploads.py``): a bounded table, a quota per client
    host, none for puts under ``resumable_min_bytes``."""

    max_uploads: int = DEFAULT_MAX_UPLOADS
    per_client: int = DEFAULT_UPLOADS_PER_CLIENT
    resumable_min_bytes: int = DEFAULT_RESUMABLE_MIN_BYTES


@dataclass(frozen=True, slots=True)
class MetricsOptions:
    """The Prometheus endpoint (``--metrics-*``): served when ``port`` is given (0: a free one,
    which STATUS reports)."""

    port: int | None = None
    host: str | None = None  # None: the host of the first network address
    connections: int = 16  # scrapes served at once (a thread each)
    # Prometheus's read-only secret: only a scrape bearing it sees the values clients chose (job
    # ids, prefixes); never one a client or a replica could use on the server.
    token: str | None = None


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """How a server runs; ``Server(options)``. Every field has the server's default."""

    store: StoreOptions = field(default_factory=StoreOptions)
    limits: Limits = field(default_factory=Limits)  # request sizes
    connections: ConnectionOptions = field(default_factory=ConnectionOptions)
    uploads: UploadOptions = field(default_factory=UploadOptions)
    metrics: MetricsOptions = field(default_factory=MetricsOptions)
    generations: GenerationConfig | None = None  # None: GenerationConfig()
    # Where it runs (HELLO and STATUS say it); None: TENSORWIRE_HOST / _RACK, read when the server
    # is built.
    location: topology.Location | None = None
    # The certificate and key that serve tls://, grpcs:// and rdmas://; ``tls.ca`` asks clients for
    # certificates that CA signed (mutual TLS).
    tls: TlsFiles | None = None
    token: str | None = None  # required from every client, in its HELLO or gRPC metadata

    def security(self) -> Security:
        """The TLS files and token as one ``Security`` (what the transports take)."""
        return Security(self.tls, self.token)


# The keywords Server and ServerThread took before ServerOptions: where each one went (a group and
# its field, or a field of ServerOptions itself). Kept for one release, with a DeprecationWarning.
_LEGACY: dict[str, tuple[str, str | None]] = {
    "limits": ("limits", None), "location": ("location", None), "generations": ("generations", None),
    "stall_timeout": ("connections", "stall_timeout"), "max_connections": ("connections", "max_connections"),
    "idle_timeout": ("connections", "idle_timeout"), "auth_timeout": ("connections", "auth_timeout"),
    "busy_poll": ("connections", "busy_poll"), "refusals": ("connections", "refusals"),
    "metrics_port": ("metrics", "port"), "metrics_host": ("metrics", "host"),
    "metrics_connections": ("metrics", "connections"), "metrics_token": ("metrics", "token"),
    "max_uploads": ("uploads", "max_uploads"), "uploads_per_client": ("uploads", "per_client"),
    "resumable_min_bytes": ("uploads", "resumable_min_bytes"),
}  # fmt: skip
_GROUPS: dict[str, Any] = {
    "connections": ConnectionOptions,
    "metrics": MetricsOptions,
    "uploads": UploadOptions,
}


def from_keywords(options: object, keywords: dict[str, Any]) -> ServerOptions:
    """``options``, or the ``ServerOptions`` the deprecated keywords of ``Server``/``ServerThread``
    say (``security=``, ``stall_timeout=``, ...; a DeprecationWarning names the new spelling)."""
    # The old positional forms, Server(store, ...) and ServerThread(urls, store), end here.
    if not isinstance(options, ServerOptions | None):
        kind = type(options).__name__
        raise TypeError(f"options must be ServerOptions, not {kind}: pass a store as store=")
    if not keywords:
        return options or ServerOptions()
    unknown = sorted(set(keywords) - set(_LEGACY) - {"security"})
    if unknown:
        raise TypeError(f"unexpected keyword arguments: {', '.join(unknown)}")
    if options is not None:
        raise TypeError("give ServerOptions or the deprecated keywords, not both")
    given = ", ".join(f"{name}=" for name in keywords)
    warnings.warn(f"{given} are deprecated: give ServerOptions(...) (tls=TlsFiles(...), token=, and the "
                  "groups connections, uploads, metrics)", DeprecationWarning, stacklevel=3)  # fmt: skip
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for name, value in keywords.items():
        if name == "security":
            if value is not None:
                top.update(tls=value.tls, token=value.token)
            continue
        group, field_name = _LEGACY[name]
        if field_name is not None:
            groups.setdefault(group, {})[field_name] = value
        elif value is not None or name != "limits":  # limits=None meant the default
            top[group] = value
    return ServerOptions(**top, **{group: _GROUPS[group](**fields) for group, fields in groups.items()})


__all__ = [
    "DEFAULT_REFUSALS",
    "ConnectionOptions",
    "MetricsOptions",
    "ServerOptions",
    "StoreOptions",
    "UploadOptions",
]
