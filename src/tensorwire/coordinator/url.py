"""Coordinator addresses: ``etcd://host:2379[,host2:2379...]/prefix`` (``etcds://``: over TLS).

The hosts are the etcd cluster's client endpoints (one is used at a time; the next after a
failure); the path is the key prefix every key of this deployment lives under (``/tensorwire``
when none is given), so that several deployments can share one etcd. Credentials never travel in
the address: etcd's user and password, and the TLS files, are passed beside it.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

DEFAULT_PORT = 2379
DEFAULT_PREFIX = "/tensorwire"
MAX_URL = 2048
MAX_ENDPOINTS = 16
MAX_HOST = 253
MAX_PREFIX = 256
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?")
_PREFIX = re.compile(r"(?:/[A-Za-z0-9._-]+)+")


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str  # a hostname, an IPv4 address, or an IPv6 address without brackets
    port: int

    @property
    def target(self) -> str:
        """``host:port`` as gRPC wants it (an IPv6 host bracketed)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class CoordinatorUrl:
    scheme: str  # the factory's key: "etcd" or "etcds"
    endpoints: tuple[Endpoint, ...]
    prefix: str  # "/a/b": a leading slash, none trailing


def parse_url(url: str) -> CoordinatorUrl:
    """The parts of a coordinator URL; ``ValueError`` naming what is wrong with it."""
    if len(url) > MAX_URL:
        raise ValueError(f"coordinator URL is {len(url)} characters long, over {MAX_URL}")
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme:
        raise ValueError(f"coordinator URL {url!r} has no scheme: write etcd://host:2379/prefix")
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        raise ValueError(f"coordinator URL {url!r} holds credentials: pass user and password apart")
    if any(c in rest for c in "?#"):
        raise ValueError(f"coordinator URL {url!r} has a query or fragment; it takes neither")
    hosts = netloc.split(",")
    if len(hosts) > MAX_ENDPOINTS:
        raise ValueError(f"coordinator URL {url!r} names {len(hosts)} hosts, over {MAX_ENDPOINTS}")
    endpoints = tuple(_endpoint(item, url) for item in hosts)
    return CoordinatorUrl(scheme.lower(), endpoints, _prefix("/" + path if slash else "", url))


def _endpoint(item: str, url: str) -> Endpoint:
    if not item:
        raise ValueError(f"coordinator URL {url!r} has an empty host")
    if item.startswith("["):
        host, bracket, tail = item[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise ValueError(f"coordinator URL {url!r}: bad IPv6 endpoint {item!r}")
        port_text = tail[1:] if tail else None
        _check_ipv6(host, url)
    else:
        host, colon, port_text_or_empty = item.partition(":")
        port_text = port_text_or_empty if colon else None
        _check_hostname(host, url)
    return Endpoint(host, _port(port_text, url))


def _check_ipv6(host: str, url: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError as exc:
        raise ValueError(f"coordinator URL {url!r}: {host!r} is not an IPv6 address") from exc


def _check_hostname(host: str, url: str) -> None:
    if len(host) > MAX_HOST or not _HOSTNAME.fullmatch(host):
        raise ValueError(f"coordinator URL {url!r}: {host[:64]!r} is not a host name or address")


def _port(text: str | None, url: str) -> int:
    if text is None:
        return DEFAULT_PORT
    if not (text.isascii() and text.isdecimal()) or len(text) > 5 or not 1 <= int(text) <= 65535:
        raise ValueError(f"coordinator URL {url!r}: port {text[:16]!r} is not in 1-65535")
    return int(text)


def _prefix(path: str, url: str) -> str:
    path = path.rstrip("/")
    if not path:
        return DEFAULT_PREFIX
    dots = any(part in (".", "..") for part in path.split("/"))
    if len(path) > MAX_PREFIX or not _PREFIX.fullmatch(path) or dots:
        raise ValueError(
            f"coordinator URL {url!r}: key prefix must be /-separated names of [A-Za-z0-9._-], "
            f"at most {MAX_PREFIX} characters"
        )
    return path
