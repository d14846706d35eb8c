"""Exposure checks: tell when a server is reachable from other machines, and warn when it is with
neither TLS nor a token.

``is_loopback`` is the one answer to "does this host only accept connections from this machine"
in the package: the shm:// listener, the dashboard, the relay and the exposure warning all ask it.
"""

from __future__ import annotations

import ipaddress

__all__ = ["exposure_warning", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine.

    ``localhost`` and loopback addresses (127.0.0.0/8, ::1, also IPv4-mapped) are; the wildcard
    addresses (``0.0.0.0``, ``::``, ``""``) and any other name or address are not.
    """
    name = host.strip().lower().strip("[]")
    if name in ("localhost", "localhost."):
        return True
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return False  # another host name: it may resolve to anything
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def exposure_warning(host: str, tls: bool, token: bool) -> str | None:
    """A one-line warning when a server on ``host`` is reachable beyond loopback with neither TLS
    nor a token, else ``None``."""
    if tls or token or is_loopback(host):
        return None
    where = repr(host) if host else "all interfaces"
    return (
        f"tensorwire server listening on {where} beyond loopback with neither TLS nor a token: "
        "anyone who can reach the port can read, overwrite and delete tensors, and traffic is "
        "unencrypted; configure TLS and a token, or listen on 127.0.0.1"
    )
