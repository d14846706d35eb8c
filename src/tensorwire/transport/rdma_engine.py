"""The Mooncake Transfer Engine, as tensorwire uses it: one seam around a foreign library.

``Engine`` loads ``mooncake.engine`` lazily (the ``tensorwire[rdma]`` extra; it needs the system
library ``libibverbs1`` even in TCP mode), initializes one ``TransferEngine`` in peer-to-peer
handshake mode (``P2PHANDSHAKE``: no etcd, no metadata server; a peer is named by
``host:rpc_port``, its *session*), and moves bytes one-sided between registered buffers.

Lifecycle: build it (``RdmaUnavailable`` if the engine cannot load or the protocol asked for
cannot be had), ``register`` the local memory a transfer touches, ``write``/``read`` against
addresses a peer registered, ``unregister``, ``close``. Transfers block in the engine, so they run
on a small thread pool of the engine's own and are awaited with a deadline.

No silent fallback: asked for ``rdma``, the engine itself installs its TCP transport when it finds
no RDMA device, without a word. So the topology is read first, and a host with no device raises
``RdmaUnavailable``; the engine's TCP mode is used only when asked for
(``TENSORWIRE_RDMA_PROTOCOL=tcp``, read when an engine is built).

What the engine exposes (README, "RDMA"): its handshake port answers any peer with this engine's
segment descriptor, which lists every registered buffer (address and length); its data port then
reads and writes any byte inside a registered buffer for whoever asks, with no authentication.
Only registered ranges: anything else is refused. That is why a server registers a buffer only
for the authenticated request it was reserved for, and unregisters it before it trusts its bytes.
The library opens those ports on every interface, whatever address it is given: an engine asked
for a loopback address is confined to the loopback interface (``rdma_sockets``), one asked for
another address to the interface that holds it (``TENSORWIRE_RDMA_INTERFACE`` names another, or
``*`` for every interface), and one that cannot be confined warns that it listens everywhere. The
library accepts every connection to its ports and keeps it until the peer closes it; a guard
thread (``rdma_sockets.Guard``) shuts down those that send nothing within ``silent_grace`` (a
second: an engine sends its request at once) and, beyond ``max_peers`` (a server's
``--max-connections``), the most idle ones, so a flood cannot take this process's descriptors.
In TCP mode an engine checks a peer's address
once per request and then keeps moving bytes for as long as the peer sends, even after the buffer
is unregistered: a server keeps such memory apart (``server/rdma_memory.py``), and a client
registers nothing in TCP mode (its engine does not need its own buffers registered to move them).

A client registers its buffers for one transfer (``Registrations``): registered memory is
readable and writable by any engine peer, so the caller's tensors are exposed only while a
transfer moves them. ``TENSORWIRE_RDMA_KEEP_REGISTERED=1`` keeps them registered between transfers
(registration pins pages, slow on a real NIC) for a fabric whose every host is trusted.

Transfers run on the engine's own threads; the buffers one touches are kept alive until that
thread returns, even when the awaiting call has already given up (a timeout, a closed
connection), and a transfer the engine's close cancels fails with ``TransportError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import importlib.metadata
import json
import logging
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tensorwire._aio import asyncio_timeout
from tensorwire.errors import RdmaUnavailable, TransportError
from tensorwire.security import is_loopback
from tensorwire.transport.rdma_sockets import LOOPBACK_DEVICE, WILDCARDS, EnginePorts, Guard, interface_of
from tensorwire.types import GiB
from tensorwire.wire.rdma import PROTOCOLS

log = logging.getLogger("tensorwire.rdma")
PROTOCOL_ENV = "TENSORWIRE_RDMA_PROTOCOL"  # "rdma" (default) or "tcp": the engine's TCP mode
HOST_ENV = "TENSORWIRE_RDMA_HOST"  # the address peers reach this engine at, when a server binds a wildcard
KEEP_ENV = "TENSORWIRE_RDMA_KEEP_REGISTERED"  # "1": a client keeps its buffers registered between transfers
# The interface an engine not asked for loopback accepts connections on: unset, the one that holds
# its address; "*", every interface (the library's own way); else that interface's name.
INTERFACE_ENV = "TENSORWIRE_RDMA_INTERFACE"
DEFAULT_MAX_PEERS = 64  # connections peers may hold open to an engine's ports (a server's: --max-connections)
SILENT_GRACE = 1.0  # seconds a connection to an engine's port may stay silent (an engine sends at once)
INSTALL_HINT = (
    "pip install 'tensorwire[rdma]' and the system library libibverbs1 (apt-get install libibverbs1)"
)
CUDA_DISTRIBUTION = "mooncake-transfer-engine"  # the CUDA build; the CPU one is "...-non-cuda"
TRANSFER_THREADS = 4
MAX_REGIONS = 256  # caller buffers a client engine keeps registered
MAX_REGISTERED_BYTES = 8 * GiB


def requested_protocol() -> str:
    """What ``TENSORWIRE_RDMA_PROTOCOL`` asks for (default ``rdma``); ValueError for anything else."""
    protocol = os.environ.get(PROTOCOL_ENV, "rdma").strip().lower() or "rdma"
    if protocol not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    return protocol


def load() -> Any:
    """The ``mooncake.engine`` module; RdmaUnavailable naming what to install if it cannot load."""
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:  # the wheel, or a shared library it links (libibverbs.so.1)
        raise RdmaUnavailable(f"rdma:// needs the Mooncake Transfer Engine ({exc}): {INSTALL_HINT}") from exc


def unavailable() -> str | None:
    """Why an ``Engine`` cannot be built here now (the engine cannot load, or ``rdma`` was asked
    for on a host without RDMA devices), or None: what a benchmark asks before it starts servers."""
    try:
        module = load()
        if requested_protocol() == "rdma" and not rdma_devices(
            module.TransferEngine().get_local_topology("")
        ):
            return f"no RDMA device on this host; {PROTOCOL_ENV}=tcp measures the engine's TCP mode"
    except (RdmaUnavailable, ValueError) as exc:
        return str(exc)
    return None


def cuda_build() -> bool:
    """Whether the installed engine is its CUDA build (it can register device memory: GPU-direct)."""
    try:
        importlib.metadata.distribution(CUDA_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def rdma_devices(topology: str) -> list[str]:
    """The RDMA devices (HCAs) named in the engine's topology JSON: ``{"cpu:0": [[preferred],
    [available]], ...}``; none on a host without RDMA hardware."""
    try:
        doc = json.loads(topology or "{}")
    except ValueError:
        return []
    devices: set[str] = set()
    for lists in doc.values() if isinstance(doc, dict) else ():
        for group in lists if isinstance(lists, list) else ():
            devices.update(str(d) for d in group if isinstance(group, list))
    return sorted(devices)


def address_of(buf: memoryview) -> int:
    """The address of ``buf``'s first byte (what the engine registers and transfers)."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def prefault(buf: memoryview) -> None:
    """Write one byte of every page of ``buf`` (whose bytes are about to be overwritten anyway):
    the engine's TCP mode moves bytes into pages that fault one by one under its locks at a tenth
    of the speed, and an RDMA NIC pins them at registration anyway."""
    if buf.nbytes and not buf.readonly:
        np.frombuffer(buf, dtype=np.uint8)[::4096] = 0


class Engine:
    """One ``TransferEngine`` of this process (see the module docstring)."""

    def __init__(
        self,
        host: str,
        protocol: str | None = None,
        *,
        exposes: bool = True,
        max_peers: int = DEFAULT_MAX_PEERS,
        silent_grace: float = SILENT_GRACE,
        on_cut: Callable[[str, int], None] | None = None,
    ) -> None:
        self.host = host
        self.max_peers = max_peers
        self.guard: Guard | None = None
        self._on_cut = on_cut
        self._shut = 0  # connections to its ports the guard shut down (logged at 1, 2, 4, ...)
        self.protocol = protocol or requested_protocol()
        module = load()
        self._te = module.TransferEngine()
        if self.protocol == "rdma":
            self._check_devices()
        rc, self.sockets = EnginePorts.around(
            lambda: self._te.initialize(host, "P2PHANDSHAKE", self.protocol, "")
        )
        if rc != 0:
            raise RdmaUnavailable(f"the transfer engine did not start on {host} ({self.protocol}, rc {rc})")
        rpc_port = int(self._te.get_rpc_port())
        self.session = f"{host}:{rpc_port}"
        self.data_ports = [port for port in self.sockets.ports if port != rpc_port]
        # Told to peers with the session: the session is only host:port, and a port this engine
        # frees can be drawn again by the next engine on this host.
        self.instance = secrets.randbits(64)
        self.gpu_direct = cuda_build()
        self._pool = concurrent.futures.ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="tw-rdma")
        self._lock = threading.Lock()
        self.registered: dict[int, int] = {}  # address -> length, what this engine exposes now
        self._peers: dict[str, int] = {}  # session -> the instance this engine reaches by that name
        self._closed = False
        self.cache = Registrations(self)
        try:
            self._expose(host, exposes)
            if self.sockets.listening:
                self.guard = Guard(self.sockets, max_peers, silent_grace, self._cut)
        except BaseException:
            self.close()
            raise

    def _expose(self, host: str, exposes: bool) -> None:
        """Keep the engine's ports to the interface asked for where the library lets us: loopback
        (else refuse to run); for another address the interface that holds it; else say that the
        library listens everywhere (if the engine ``exposes`` memory at all: a client engine in
        TCP mode registers none)."""
        if is_loopback(host):
            if not self.sockets.listening:
                raise RdmaUnavailable(f"cannot find the transfer engine's ports to keep them on {host}")
            try:
                self.sockets.confine_to_loopback()
            except OSError as exc:
                raise RdmaUnavailable(
                    f"cannot keep the transfer engine's ports {self.sockets.ports} on loopback ({exc}); the "
                    "library listens on every interface (SO_BINDTODEVICE needs Linux 5.7 or CAP_NET_RAW)"
                ) from exc
            return
        if host in WILDCARDS or not self.sockets.listening:
            return
        device, why = _device_for(host)
        if device is not None:
            try:
                self.sockets.confine(device)
                log.info(
                    "the transfer engine's ports %s accept connections on %s only", self.sockets.ports, device
                )
                return
            except OSError as exc:
                why = f"SO_BINDTODEVICE {device} refused ({exc}; it needs Linux 5.7 or CAP_NET_RAW)"
        if exposes:
            log.warning(
                "the transfer engine asked for %s listens on every interface (ports %s): %s; any host "
                "that reaches them can read and write the buffers registered for requests under way "
                "(README, RDMA)",
                host,
                ", ".join(map(str, self.sockets.ports)),
                why,
            )

    def _cut(self, reason: str, count: int) -> None:
        """The guard shut down ``count`` connections to the engine's ports (on its thread): logged
        at the 1st, 2nd, 4th, ... (a flood logs a few lines), and told to ``on_cut``."""
        before, self._shut = self._shut, self._shut + count
        if before.bit_length() != self._shut.bit_length():
            why = (
                f"beyond its bound of {self.max_peers} connections (--max-connections)"
                if reason == "limit"
                else "that sent nothing in time"
            )
            log.warning(
                "the transfer engine shut down %d connections to its ports %s %s; %d so far",
                count,
                ", ".join(map(str, self.sockets.ports)),
                why,
                self._shut,
            )
        if self._on_cut is not None:
            self._on_cut(reason, count)

    def cut_connections(self, timeout: float = 2.0) -> bool:
        """Cut the connections peers opened to this engine's data ports (TCP mode), and wait (up
        to ``timeout``) for the engine to close them: afterwards no request of a peer touches
        memory the engine was told about before. False if some stayed open
        (``rdma_sockets.EnginePorts.cut``)."""
        return self.sockets.cut(self.data_ports, timeout)

    def _check_devices(self) -> None:
        devices = rdma_devices(self._te.get_local_topology(""))
        if not devices:
            raise RdmaUnavailable(
                "rdma:// found no RDMA device on this host (the engine would fall back to TCP without "
                f"a word); set {PROTOCOL_ENV}=tcp to use the engine's TCP mode on purpose"
            )
        log.info("rdma devices: %s", ", ".join(devices))

    def register(self, address: int, length: int, location: str = "cpu:0") -> None:
        """Expose ``length`` bytes at ``address`` to peers (and to this engine's transfers)."""
        with self._lock:
            if self._closed:
                raise TransportError("the transfer engine is closed")
            rc = self._te.register_memory(address, length, location)
            if rc != 0:
                raise TransportError(
                    f"the engine refused to register {length} bytes at {address:#x} (rc {rc})"
                )
            self.registered[address] = length

    def unregister(self, address: int) -> None:
        """Stop exposing the buffer registered at ``address`` (peers' transfers to it fail from now)."""
        with self._lock:
            if self.registered.pop(address, None) is None or self._closed:
                return
            rc = self._te.unregister_memory(address)
        if rc != 0:
            log.warning("the engine failed to unregister the buffer at %#x (rc %s)", address, rc)

    @property
    def closed(self) -> bool:
        return self._closed

    def claim(self, session: str, instance: int) -> bool:
        """Whether this engine may reach the peer engine ``instance`` by the name ``session``:
        False when it has reached another engine by that name. The transfer engine keeps what it
        learned of a peer (its data port, its buffers) by name for its whole life, so a peer that
        drew a port an earlier one freed would be written at the earlier one's ports."""
        with self._lock:
            return self._peers.setdefault(session, instance) == instance

    async def write(
        self, session: str, local: int, remote: int, length: int, *, timeout: float, keep: object = None
    ) -> None:
        """``length`` bytes at ``local`` into the peer's registered ``remote``; ``keep`` (what owns
        the memory at ``local``) stays alive until the engine's thread is done with it."""
        await self._transfer("transfer_sync_write", "write", (session, local, remote, length), timeout, keep)

    async def read(
        self, session: str, local: int, remote: int, length: int, *, timeout: float, keep: object = None
    ) -> None:
        """``length`` bytes of the peer's registered ``remote`` into ``local`` (``keep``: as ``write``)."""
        await self._transfer("transfer_sync_read", "read", (session, local, remote, length), timeout, keep)

    async def _transfer(
        self, method: str, what: str, args: tuple[str, int, int, int], timeout: float, keep: object
    ) -> None:
        with self._lock:
            te = self._te
        if te is None:
            raise TransportError("the transfer engine is closed")
        call: Callable[..., int] = getattr(te, method)  # holds the engine while it runs
        session, length = args[0], args[3]
        try:
            # ``keep`` rides with the call: the memory lives until the engine's thread returns, even
            # if the wait below ends first (a timeout, a cancelled request).
            future = asyncio.get_running_loop().run_in_executor(self._pool, _call, call, args, keep)
        except RuntimeError as exc:  # the pool was shut down: the engine closed meanwhile
            raise TransportError("the transfer engine is closed") from exc
        async with asyncio_timeout(timeout, f"an engine {what} of {length} bytes with {session}"):
            rc = await _engine_result(future)
        if rc != 0:
            # The peer's engine refused (the buffer is no longer registered) or is gone.
            raise TransportError(f"the engine's {what} of {length} bytes with {session} failed (rc {rc})")

    def close(self) -> None:
        """Unregister everything, stop the transfer threads (transfers under way finish first) and
        let the engine go: its ports and threads are freed once the last transfer returns."""
        if self.guard is not None:
            self.guard.close()  # first: it holds duplicates of the listening sockets
        with self._lock:
            if self._closed:
                return
            for address in list(self.registered):
                self._te.unregister_memory(address)
            self.registered.clear()
            self._closed = True
            self._te = None
        self.cache.forget()  # after the engine's lock: the cache takes its own lock, then the engine's
        self._pool.shutdown(wait=False, cancel_futures=True)


def _device_for(host: str) -> tuple[str | None, str]:
    """The interface an engine asked for ``host`` (not loopback) should accept connections on, or
    None and why not: ``TENSORWIRE_RDMA_INTERFACE`` when set (``*``: none), else the interface that
    holds the address. A client on this host that connects to that address arrives on it too."""
    chosen = os.environ.get(INTERFACE_ENV, "").strip()
    if chosen == "*":
        return None, f"{INTERFACE_ENV}=* asks for every interface"
    if chosen:
        return chosen, ""
    device = interface_of(host)
    if device is None:
        return None, f"no interface here holds {host} (set {INTERFACE_ENV} to name one)"
    if device == LOOPBACK_DEVICE:  # an address kept on lo (a service address): peers arrive elsewhere
        return None, f"{host} is held by the loopback interface (set {INTERFACE_ENV} to name another)"
    return device, ""


def _call(call: Callable[..., int], args: tuple[str, int, int, int], keep: object) -> int:
    """One transfer on an engine thread; ``keep`` (what owns the memory it moves) is referenced by
    this frame until the engine's call returns, whatever the awaiting side has given up meanwhile."""
    try:
        return call(*args)
    finally:
        del keep  # only now may the memory go


async def _engine_result(future: asyncio.Future[int]) -> int:
    """The result of a transfer; TransportError when the engine's close cancelled it before it
    began (not the caller's cancellation, which goes on as usual)."""
    try:
        return await future
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if future.cancelled() and task is not None and not task.cancelling():
            raise TransportError("the transfer engine closed before the transfer began") from None
        raise


class Registrations:
    """The caller buffers registered with one engine (``engine.cache``) for its transfers: in TCP
    mode none (the engine moves a caller's bytes without it, and registered memory is what a peer
    can reach); in RDMA mode each for one transfer, unless ``TENSORWIRE_RDMA_KEEP_REGISTERED=1``
    keeps them registered after it (registration pins pages and is slow on real NICs), bounded in
    count and bytes, least recently used unregistered first. A registration keeps its buffer
    alive, so its address cannot be reused for other memory while the engine still maps it."""

    def __init__(self, engine: Engine, max_regions: int = MAX_REGIONS, max_bytes: int = MAX_REGISTERED_BYTES):
        self.engine = engine
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self.needed = engine.protocol != "tcp"
        self.keep = self.needed and os.environ.get(KEEP_ENV, "").strip() == "1"
        self._regions: OrderedDict[int, tuple[memoryview, int]] = OrderedDict()  # address -> (buf, uses)
        self._bytes = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def using(self, buf: memoryview, landing: bool = False) -> Iterator[int]:
        """``buf``'s address, registered for as long as the block runs (and cached after it); a
        ``landing`` buffer (bytes are about to land in it) has its pages faulted in when new."""
        address = address_of(buf)
        if not self.needed:
            yield address
            return
        region = self._acquire(buf, address, landing)
        try:
            yield address
        finally:
            with self._lock:
                held = self._regions.get(region)
                if held is not None:
                    self._regions[region] = (held[0], held[1] - 1)
                self._evict()

    def _acquire(self, buf: memoryview, address: int, landing: bool) -> int:
        """The registered region that holds ``buf`` (its start address), registering it if none
        does. A cached region keeps its memory alive, so an address inside it is that memory."""
        end = address + buf.nbytes
        with self._lock:
            for start, (held, uses) in self._regions.items():
                if start <= address and end <= start + held.nbytes:
                    self._regions[start] = (held, uses + 1)
                    self._regions.move_to_end(start)
                    return start
            # The engine refuses overlapping registrations: drop the idle regions this one overlaps.
            overlapping = [a for a, (h, _) in self._regions.items() if a < end and address < a + h.nbytes]
            if any(self._regions[a][1] for a in overlapping):
                raise TransportError(f"{buf.nbytes} bytes at {address:#x} overlap a buffer in a transfer now")
            for start in overlapping:
                self._drop(start)
            if landing:
                prefault(buf)
            self.engine.register(address, buf.nbytes)
            self._regions[address] = (buf, 1)  # keeps the memory alive while the engine maps it
            self._bytes += buf.nbytes
            return address

    def _evict(self) -> None:
        idle = [a for a, (_, uses) in self._regions.items() if uses == 0]
        while idle and (not self.keep or self._over()):
            self._drop(idle.pop(0))

    def _over(self) -> bool:
        return len(self._regions) > self.max_regions or self._bytes > self.max_bytes

    def _drop(self, address: int) -> None:
        buf, _ = self._regions.pop(address)
        self._bytes -= buf.nbytes
        self.engine.unregister(address)

    def forget(self) -> None:
        """Let every cached buffer go (the engine closed: it unregistered them all)."""
        with self._lock:
            self._regions.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._regions)
