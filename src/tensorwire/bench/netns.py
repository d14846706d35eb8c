"""Network namespaces joined by a bridge: separate "hosts" on one machine, for benchmarks.

``Fabric(n, rate)`` makes n namespaces, each with one veth link to a bridge in this namespace,
addresses ``10.199.<k>.1`` .. ``.n`` on one subnet, optionally each link shaped to ``rate`` bits/s
in both directions (``tc`` tbf), and removes all of it on exit. A process runs inside a namespace
under ``fabric.wrapper(i)`` (``ip netns exec ...``); ``fabric.counters(i)`` reads the bytes its
link carried (the host end of the veth: ``rx`` is what the namespace sent, ``tx`` what it got);
``fabric.inside(i)`` names the link's end inside the namespace (for GLOO_SOCKET_IFNAME, say).

Making namespaces needs CAP_NET_ADMIN (root in most containers); ``Unavailable`` says why not.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from types import TracebackType


class Unavailable(RuntimeError):
    """This machine does not let us make namespaces, links or shapers; the message says why."""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=10)
    except FileNotFoundError as exc:
        raise Unavailable(f"{cmd[0]} is not installed") from exc
    except subprocess.CalledProcessError as exc:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {exc.stderr.decode().strip()}") from exc


class Fabric:
    def __init__(self, count: int, rate_bits: int | None = None) -> None:
        tag = os.getpid() % 1000
        self.count = count
        self.rate_bits = rate_bits
        self.bridge = f"twb{tag:03d}"
        self.names = [f"twsc{tag:03d}-{i}" for i in range(count)]
        self.host_links = [f"twh{tag:03d}{i:02d}" for i in range(count)]
        self.addresses = [f"10.199.{tag % 250}.{i + 1}" for i in range(count)]
        self._made: list[tuple[str, str]] = []  # what to remove, in reverse order

    def __enter__(self) -> Fabric:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _make(self) -> None:
        _ip("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("ip", "link", "set", self.bridge, "up")
        for i, (ns, host, address) in enumerate(
            zip(self.names, self.host_links, self.addresses, strict=True)
        ):
            inside = self.inside(i)
            _ip("ip", "netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("ip", "link", "add", host, "type", "veth", "peer", "name", inside)
            self._made.append(("link", host))  # removing one end removes the pair
            _ip("ip", "link", "set", inside, "netns", ns)
            _ip("ip", "link", "set", host, "master", self.bridge)
            _ip("ip", "link", "set", host, "up")
            _ip("ip", "addr", "add", f"{address}/24", "dev", inside, ns=ns)
            _ip("ip", "link", "set", inside, "up", ns=ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            if self.rate_bits:
                self._shape(i, inside)

    def _shape(self, i: int, inside: str) -> None:
        """A token bucket on both ends of the link: ``rate_bits`` each way, like a NIC port."""
        shaper = ["root", "tbf", "rate", f"{self.rate_bits}bit", "burst", "256kb", "latency", "100ms"]
        _ip("tc", "qdisc", "add", "dev", self.host_links[i], *shaper)
        _ip("tc", "qdisc", "add", "dev", inside, *shaper, ns=self.names[i])

    def inside(self, i: int) -> str:
        """The name of namespace i's end of its link, as seen inside it (GLOO_SOCKET_IFNAME)."""
        return f"twn{self.host_links[i][3:]}"

    def wrapper(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[i]]

    def counters(self, i: int) -> tuple[int, int]:
        """(bytes sent by namespace i, bytes it received) so far, frames' headers included."""
        stats = Path("/sys/class/net") / self.host_links[i] / "statistics"
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def close(self) -> None:
        for kind, name in reversed(self._made):
            with contextlib.suppress(Unavailable):
                if kind == "link":
                    _ip("ip", "link", "del", name)
                else:
                    _ip("ip", "netns", "del", name)
        self._made.clear()
