"""Leadership of parameter-server replica slots from a coordinator (etcd), chosen by URL scheme
from one table.

``open_coordinator("etcd://10.0.0.5:2379,10.0.0.6:2379/tensorwire")`` opens the ``Coordinator``
(base.py: its lifecycle) for the address's scheme; ``etcds://`` is the same over TLS. Only this
module names the concrete coordinators, and it imports each only when its scheme is asked for: the
etcd client (``aetcd``, the ``etcd`` extra) is not a dependency of a plain install. ``LocalEtcd``
(local.py) runs a throwaway etcd on loopback for tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tensorwire.coordinator.base import DEFAULT_TIMEOUT, Coordinator, InSync, Leader, Term
from tensorwire.coordinator.url import CoordinatorUrl, parse_url
from tensorwire.errors import UnsupportedTransport
from tensorwire.security import TlsFiles

__all__ = ["COORDINATORS", "DEFAULT_TIMEOUT", "Coordinator", "InSync", "Leader", "Term", "open_coordinator"]


class CoordinatorFactory(Protocol):
    def __call__(
        self,
        url: CoordinatorUrl,
        *,
        tls: TlsFiles | None,
        user: str | None,
        password: str | None,
        timeout: float,
    ) -> Coordinator: ...


def _etcd() -> CoordinatorFactory:
    try:
        from tensorwire.coordinator.etcd import EtcdCoordinator
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("aetcd"):
            raise
        raise UnsupportedTransport(
            "etcd:// needs the etcd client aetcd: pip install 'tensorwire[etcd]'"
        ) from exc
    return EtcdCoordinator


# scheme -> the function that imports its coordinator (and says which extra it needs)
COORDINATORS: dict[str, Callable[[], CoordinatorFactory]] = {"etcd": _etcd, "etcds": _etcd}


def open_coordinator(
    url: str,
    *,
    tls: TlsFiles | None = None,
    user: str | None = None,
    password: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Coordinator:
    """The coordinator at ``url`` (nothing is contacted until its first call). ``tls``: the CA and
    client certificate for ``etcds://``; ``user``/``password``: etcd's own authentication.
    ``ValueError`` for a malformed URL; ``UnsupportedTransport`` for a scheme not in the table, or
    one whose client is not installed."""
    parsed = parse_url(url)
    load = COORDINATORS.get(parsed.scheme)
    if load is None:
        known = ", ".join(f"{name}://" for name in COORDINATORS)
        raise UnsupportedTransport(
            f"coordinator URL {url!r}: scheme {parsed.scheme}:// is not one of {known}"
        )
    if tls is not None and parsed.scheme != "etcds":
        raise ValueError(f"coordinator URL {url!r}: TLS files were given, but TLS is etcds://")
    return load()(parsed, tls=tls, user=user, password=password, timeout=timeout)
