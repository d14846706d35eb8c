"""Leadership of parameter-server replica slots from a coordinator (etcd), chosen by URL scheme
from one table.

``open_coordinator("etcd://10.0.0.5:2379,10.0.0.6:2379/tensorwire")`` opens the ``Coordinator``
(base.py: its lifecycle) for the address's scheme; ``etcds://`` is the same over TLS. Only this
module names the concrete coordinators. ``LocalEtcd`` (local.py) runs a throwaway etcd on loopback
for tests and benchmarks.
"""

from __future__ import annotations

from tensorwire.coordinator.base import Coordinator, Leader, Term
from tensorwire.coordinator.etcd import DEFAULT_TIMEOUT, EtcdCoordinator
from tensorwire.coordinator.url import CoordinatorUrl, parse_url
from tensorwire.errors import UnsupportedTransport
from tensorwire.security import TlsFiles

__all__ = ["COORDINATORS", "Coordinator", "Leader", "Term", "open_coordinator"]


COORDINATORS: dict[str, type[EtcdCoordinator]] = {"etcd": EtcdCoordinator, "etcds": EtcdCoordinator}


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
    ``ValueError`` for a malformed URL, ``UnsupportedTransport`` for a scheme not in the table."""
    parsed: CoordinatorUrl = parse_url(url)
    kind = COORDINATORS.get(parsed.scheme)
    if kind is None:
        known = ", ".join(f"{name}://" for name in COORDINATORS)
        raise UnsupportedTransport(
            f"coordinator URL {url!r}: scheme {parsed.scheme}:// is not one of {known}"
        )
    if tls is not None and parsed.scheme != "etcds":
        raise ValueError(f"coordinator URL {url!r}: TLS files were given, but TLS is etcds://")
    return kind(parsed, tls=tls, user=user, password=password, timeout=timeout)
