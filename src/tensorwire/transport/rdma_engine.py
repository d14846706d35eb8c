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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.metadata
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorwire._aio import asyncio_timeout
from tensorwire.errors import RdmaUnavailable, TransportError
from tensorwire.wire.rdma import PROTOCOLS

log = logging.getLogger("tensorwire.rdma")
PROTOCOL_ENV = "TENSORWIRE_RDMA_PROTOCOL"  # "rdma" (default) or "tcp": the engine's TCP mode
HOST_ENV = "TENSORWIRE_RDMA_HOST"  # the address peers reach this engine at, when a server binds a wildcard
INSTALL_HINT = (
    "pip install 'tensorwire[rdma]' and the system library libibverbs1 (apt-get install libibverbs1)"
)
CUDA_DISTRIBUTION = "mooncake-transfer-engine"  # the CUDA build; the CPU one is "...-non-cuda"
TRANSFER_THREADS = 4


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

    def __init__(self, host: str, protocol: str | None = None) -> None:
        self.protocol = protocol or requested_protocol()
        module = load()
        self._te = module.TransferEngine()
        if self.protocol == "rdma":
            self._check_devices()
        rc = self._te.initialize(host, "P2PHANDSHAKE", self.protocol, "")
        if rc != 0:
            raise RdmaUnavailable(f"the transfer engine did not start on {host} ({self.protocol}, rc {rc})")
        self.session = f"{host}:{self._te.get_rpc_port()}"
        self.gpu_direct = cuda_build()
        self._pool = concurrent.futures.ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="tw-rdma")
        self._lock = threading.Lock()
        self.registered: dict[int, int] = {}  # address -> length, what this engine exposes now
        self._closed = False

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

    async def write(self, session: str, local: int, remote: int, length: int, *, timeout: float) -> None:
        """``length`` bytes at ``local`` into the peer's registered ``remote``."""
        await self._transfer(self._te.transfer_sync_write, "write", (session, local, remote, length), timeout)

    async def read(self, session: str, local: int, remote: int, length: int, *, timeout: float) -> None:
        """``length`` bytes of the peer's registered ``remote`` into ``local``."""
        await self._transfer(self._te.transfer_sync_read, "read", (session, local, remote, length), timeout)

    async def _transfer(
        self, call: Callable[..., int], what: str, args: tuple[str, int, int, int], timeout: float
    ) -> None:
        if self._closed:
            raise TransportError("the transfer engine is closed")
        session, length = args[0], args[3]
        future = asyncio.get_running_loop().run_in_executor(self._pool, call, *args)
        async with asyncio_timeout(timeout, f"an engine {what} of {length} bytes with {session}"):
            rc = await future
        if rc != 0:
            # The peer's engine refused (the buffer is no longer registered) or is gone.
            raise TransportError(f"the engine's {what} of {length} bytes with {session} failed (rc {rc})")

    def close(self) -> None:
        """Unregister everything and stop the transfer threads (transfers under way finish first)."""
        with self._lock:
            for address in list(self.registered):
                self._te.unregister_memory(address)
            self.registered.clear()
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)


_client_engines: dict[str, Engine] = {}
_client_lock = threading.Lock()


def client_engine(host: str) -> Engine:
    """This process's client engine for the local address ``host`` (made on first use, kept for
    the life of the process: registration is what costs, so clients share one engine)."""
    with _client_lock:
        engine = _client_engines.get(host)
        if engine is None or engine.protocol != requested_protocol():
            engine = _client_engines[host] = Engine(host)
        return engine
