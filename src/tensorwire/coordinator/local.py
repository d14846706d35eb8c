"""A single-member etcd on loopback, as a child process: for tests and the benchmark.

``LocalEtcd`` picks free loopback ports (client and peer), keeps its data in a directory of its
own (or the one given), and starts Debian's ``etcd`` (``apt-get install etcd-server``, 3.4)::

    with LocalEtcd() as etcd:           # started, and healthy
        coordinator = open_coordinator(etcd.url)
        etcd.kill()                     # SIGKILL: the coordinator sees it gone
        etcd.start()                    # the same ports and data: what it held is back

Lifecycle: ``start()`` (``__enter__``) returns once etcd answers its health check, or raises
``RuntimeError`` with the tail of its log; ``kill()`` or ``stop()`` end the process; ``start()``
may follow either. ``stop()`` (``__exit__``, also on an exception) always ends the process and
removes a data directory it made.

Its timings are a test's, not production's: a 50 ms heartbeat and 500 ms election timeout make
etcd's smallest lease 1 s (the defaults make it 2 s, and round a 1 s TTL up).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from tensorwire.security import TlsFiles, client_ssl_context

START_TIMEOUT = 20.0
_HEALTH_POLL = 0.05


class LocalEtcd:
    """One etcd process on loopback (see the module docstring for the lifecycle)."""

    def __init__(
        self,
        prefix: str = "/tensorwire",
        data_dir: Path | None = None,
        extra_args: Sequence[str] = (),
        tls: TlsFiles | None = None,
    ) -> None:
        self.prefix = prefix
        # TLS (etcds://): the server's cert and key; a ca asks clients for certificates it signed.
        # The health check presents the server's own certificate (development certificates,
        # security/certs.py, serve both ways).
        self.tls = tls
        self.extra_args = tuple(extra_args)  # more etcd flags: "--auth-token-ttl=1"
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self._own_dir = data_dir is None
        self.data_dir = Path(tempfile.mkdtemp(prefix="tw-etcd-")) if data_dir is None else data_dir
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "etcd" if self.tls is None else "etcds"
        return f"{scheme}://127.0.0.1:{self.client_port}{self.prefix}"

    @property
    def client_url(self) -> str:
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = START_TIMEOUT) -> LocalEtcd:
        if self._proc is not None and self._proc.poll() is None:
            return self
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not on PATH: install it (as root: apt-get install etcd-server)")
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(self._argv(binary), stdout=log, stderr=subprocess.STDOUT)
        self._proc = proc
        try:
            self._wait_healthy(proc, timeout)
        except BaseException:
            self.stop(remove=False)
            raise
        return self

    def kill(self) -> None:
        """SIGKILL, and wait for the process to be gone (its data stays)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc.wait(10)
            self._proc = None

    def stop(self, *, remove: bool = True) -> None:
        """End the process (SIGTERM, then SIGKILL); remove a data directory this object made."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if remove and self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.log_path.unlink(missing_ok=True)

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-limit:].decode("utf-8", "replace")
        except OSError:
            return ""

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _argv(self, binary: str) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            binary,
            "--name=local",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.client_url}",
            f"--advertise-client-urls={self.client_url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=local={peer}",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--logger=zap",
            "--log-outputs=stderr",
            *self._tls_args(),
            *self.extra_args,
        ]

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        if self.tls.cert is None or self.tls.key is None:
            raise ValueError("LocalEtcd with TLS needs the server's cert and key")
        args = [f"--cert-file={self.tls.cert}", f"--key-file={self.tls.key}"]
        if self.tls.ca is not None:
            args += [f"--trusted-ca-file={self.tls.ca}", "--client-cert-auth"]
        return args

    def _wait_healthy(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {proc.returncode}:\n{self.log_tail()}")
            if _healthy(self.client_url + "/health", self._health_context()):
                return
            time.sleep(_HEALTH_POLL)
        raise RuntimeError(f"etcd did not become healthy within {timeout:.3g}s:\n{self.log_tail()}")

    def _health_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        return client_ssl_context(TlsFiles(cert=self.tls.cert, key=self.tls.key, ca=self.tls.ca))


def _healthy(url: str, context: ssl.SSLContext | None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=context) as reply:  # our own loopback URL
            return b'"health":"true"' in reply.read(4096)
    except (OSError, urllib.error.URLError):
        return False


def _free_port() -> int:
    # Bound and released: another process could take it before etcd binds, which on loopback in a
    # test run is rare enough (and etcd then fails fast, naming the address in its log).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
