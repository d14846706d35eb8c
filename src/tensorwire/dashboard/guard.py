"""What keeps the dashboard's page a safe network service: its bounds (``Limits``), the Host check
against DNS rebinding (``HostCheck``), the login throttle (``LoginThrottle``) and the count of open
event streams (``StreamSlots``). Pure bookkeeping, no aiohttp: ``app`` applies them to requests.

Every table here is bounded: the throttle remembers at most ``Limits.throttle_table`` client
addresses, and as many that logged in (the least recently seen is forgotten first; the global
bucket still holds then), the stream slots at most ``Limits.max_streams`` streams in all.
"""

from __future__ import annotations

import ipaddress
import math
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")  # what a browser on this machine calls it


@dataclass(frozen=True)
class Limits:
    """The page's bounds; the flags of ``tensorwire dashboard`` set the ones an operator tunes."""

    max_connections: int = 64  # HTTP connections open at once, TLS handshakes included (--max-connections)
    max_streams: int = 16  # /events streams open at once, all clients together (--max-streams)
    streams_per_client: int = 4  # /events streams one client address may hold
    idle_timeout: float = 15.0  # a connection with no request in this time is closed (aiohttp keepalive)
    read_timeout: float = 10.0  # a request body (the login form) must arrive within this
    handshake_timeout: float = 10.0  # a TLS handshake must end within this
    write_timeout: float = 10.0  # a stream event the browser does not take within this ends the stream
    login_burst: int = 5  # login attempts one client address may make at once...
    login_per_minute: float = 5.0  # ...and then this many a minute
    login_global_burst: int = 20  # FAILED attempts, all clients together, at once...
    login_global_per_minute: float = 60.0  # ...and then this many a minute
    trust_seconds: float = 12 * 3600.0  # an address that logged in skips the global bucket this long
    throttle_table: int = 4096  # client addresses the login throttle remembers
    connections_per_client: int = 16  # HTTP connections one client address may hold open
    # How the flags that set these bounds begin, for the messages that name them: `tensorwire
    # dashboard --max-streams`, `tensorwire serve --dashboard-max-streams`.
    flags: str = "--"

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_streams", "streams_per_client", "login_burst",
                     "login_global_burst", "throttle_table", "connections_per_client"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be at least 1")


def client_key(remote: str | None) -> str:
    """The address a client is counted under: its IP, or for IPv6 its /64 (one host holds a
    whole /64, so counting single addresses would let it rotate through them)."""
    if not remote:
        return "?"
    try:
        addr = ipaddress.ip_address(remote)
    except ValueError:
        return remote
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{addr}/64", strict=False))
    return str(addr.ipv4_mapped or addr) if isinstance(addr, ipaddress.IPv6Address) else str(addr)


def host_name(header: str | None) -> str | None:
    """The name in a ``Host`` header (``[::1]:8265`` -> ``::1``), lower case; None if unparsable."""
    if not header or any(c in header for c in "/?#@ \\"):
        return None
    try:
        name = urllib.parse.urlsplit(f"//{header}").hostname
    except ValueError:
        return None
    return name.rstrip(".") if name else None


class HostCheck:
    """Which ``Host`` headers the page answers. A page without a login (bound to loopback) answers
    only the names this machine's browser uses for it (localhost, 127.0.0.1, ::1), the address it
    is bound to and the ``--allowed-host`` names: a web page elsewhere that points its own name at
    127.0.0.1 (DNS rebinding) sends its own name, and is refused. A page with a login checks only
    when ``--allowed-host`` names are given (the login, not the name, keeps it private)."""

    def __init__(self, bound: str, allowed: Iterable[str], login: bool) -> None:
        names = {host_name(n) or n.lower() for n in allowed if n}
        self.enforced = not login or bool(names)
        bound_name = bound.strip("[]").lower()
        if bound_name and bound_name not in ("0.0.0.0", "::"):
            names.add(bound_name)
        self.names = frozenset(names | set(LOOPBACK_NAMES))

    def allows(self, header: str | None) -> bool:
        return not self.enforced or host_name(header) in self.names


class _Bucket:
    """A token bucket: ``burst`` at once, refilled at ``rate`` a second."""

    __slots__ = ("level", "t")

    def __init__(self, burst: int, now: float) -> None:
        self.level, self.t = float(burst), now

    def take(self, burst: int, rate: float, now: float) -> float:
        """0.0 if a token was taken, else the seconds until one is there."""
        wait = self.peek(burst, rate, now)
        if wait == 0.0:
            self.level -= 1.0
        return wait

    def peek(self, burst: int, rate: float, now: float) -> float:
        """0.0 if a token is there (none is taken), else the seconds until one is."""
        self.level = min(float(burst), self.level + (now - self.t) * rate)
        self.t = now
        return 0.0 if self.level >= 1.0 else (1.0 - self.level) / rate

    def charge(self, burst: int, rate: float, now: float) -> None:
        """Take a token whether or not one is there (down to a debt of ``burst``): what was spent
        while others were in flight is paid for by the next ones."""
        self.peek(burst, rate, now)
        self.level = max(self.level - 1.0, -float(burst))


class LoginThrottle:
    """Login attempts, limited per client address (every attempt) and in all (failed attempts
    only: a bucket every client drains, so that guesses from many addresses are slowed too).
    ``admit`` says how long a client must wait (0.0: go ahead); the page then reports how the
    attempt went (``failed``, ``succeeded``). Successes never drain the global bucket, and an
    address that logged in within ``Limits.trust_seconds`` is not held by it (only by its own): a
    flood of wrong tokens from many addresses keeps out new addresses, not those that know the
    token. (A browser with a valid session never gets here: the page lets it through first.) The
    tables are bounded: beyond ``Limits.throttle_table`` addresses the least recently seen is
    forgotten."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self.refused = 0
        self._clients: OrderedDict[str, _Bucket] = OrderedDict()
        self._trusted: OrderedDict[str, float] = OrderedDict()  # address -> when it last logged in
        self._failures = _Bucket(limits.login_global_burst, clock())

    def admit(self, client: str) -> float:
        lim, now = self.limits, self.clock()
        bucket = self._clients.pop(client, None) or _Bucket(lim.login_burst, now)
        self._clients[client] = bucket  # most recently seen last
        while len(self._clients) > lim.throttle_table:
            self._clients.popitem(last=False)
        wait = bucket.take(lim.login_burst, lim.login_per_minute / 60.0, now)
        if wait == 0.0 and not self.trusted(client, now):
            wait = self._failures.peek(lim.login_global_burst, self._global_rate, now)
            if wait:
                bucket.level += 1.0  # the global refusal does not spend the client's own attempt
        if wait:
            self.refused += 1
        return wait

    def failed(self, client: str) -> None:
        """A wrong token: charged to every client's bucket (the client's own was at ``admit``)."""
        self._failures.charge(self.limits.login_global_burst, self._global_rate, self.clock())

    def succeeded(self, client: str) -> None:
        """The right token: ``client`` is no longer held by the global bucket for a while."""
        self._trusted.pop(client, None)
        self._trusted[client] = self.clock()
        while len(self._trusted) > self.limits.throttle_table:
            self._trusted.popitem(last=False)

    def trusted(self, client: str, now: float) -> bool:
        since = self._trusted.get(client)
        return since is not None and now - since < self.limits.trust_seconds

    @property
    def _global_rate(self) -> float:
        return self.limits.login_global_per_minute / 60.0

    def __len__(self) -> int:
        return len(self._clients)


class StreamSlots:
    """Open event streams, per client address and in all (``Limits``). ``take`` returns why a new
    stream is refused (None: it was counted; ``give`` it back when it ends)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.open: dict[str, int] = {}
        self.refused = 0

    def take(self, client: str) -> str | None:
        lim = self.limits
        if sum(self.open.values()) >= lim.max_streams:
            why = f"{lim.max_streams} event streams are open ({lim.flags}max-streams)"
        elif self.open.get(client, 0) >= lim.streams_per_client:
            why = f"this client has {lim.streams_per_client} event streams open already"
        else:
            self.open[client] = self.open.get(client, 0) + 1
            return None
        self.refused += 1
        return why

    def give(self, client: str) -> None:
        left = self.open.get(client, 0) - 1
        if left > 0:
            self.open[client] = left
        else:
            self.open.pop(client, None)


def retry_after(seconds: float) -> str:
    """A ``Retry-After`` header value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


__all__ = ["HostCheck", "Limits", "LoginThrottle", "StreamSlots", "client_key", "host_name", "retry_after"]
