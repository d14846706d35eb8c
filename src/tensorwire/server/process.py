"""Real server processes for integration and fault tests.

``ServerProcess`` runs ``tensorwire serve`` in a child process on a loopback port, waits (with a
deadline, never a fixed sleep) until it reports its address, and always ends it on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType


def wait_for(condition: object, timeout: float, what: str, interval: float = 0.01) -> None:
    """Poll ``condition()`` until it is true; TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout}s for {what}")
        time.sleep(interval)


def run_threads(target: Callable[[int], object], count: int, timeout: float) -> None:
    """Run ``target(i)`` for i in range(count) in threads (workers of a test); re-raise the first
    error; fail, naming the timeout, if one is still running after ``timeout`` seconds."""
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            target(index)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"waited {timeout}s for {count} worker threads to finish")
    if errors:
        raise errors[0]


class ServerProcess:
    """``tensorwire ps serve`` (a store and parameter server, whose flags ``extra`` may give) in a
    child process; ``url`` is its real address."""

    def __init__(
        self,
        listen: str = "tcp://127.0.0.1:0",
        capacity: str = "4GiB",
        data_dir: Path | None = None,
        start_timeout: float = 30.0,
        extra: Sequence[str] = (),
        *,
        wrapper: Sequence[str] = (),
    ) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="tensorwire-srv-")
        ready = Path(self._dir.name) / "ready"
        # wrapper: a command the server runs under, e.g. ("ip", "netns", "exec", "ns1").
        cmd = [*wrapper, sys.executable, "-m", "tensorwire.cli", "ps", "serve", "--listen", listen]
        cmd += ["--capacity", capacity]
        cmd += ["--ready-file", str(ready)]
        if data_dir is not None:
            cmd += ["--data-dir", str(data_dir)]
        cmd += extra
        self._log = open(Path(self._dir.name) / "log", "w+b")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_for(
                lambda: ready.exists() or self.proc.poll() is not None, start_timeout, "the server to start"
            )
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
        except BaseException:
            self.stop()
            raise
        self.urls = ready.read_text().split()
        self.url = self.urls[0]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: signal.Signals) -> None:
        os.kill(self.proc.pid, sig)

    def output(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self, timeout: float = 10.0) -> int:
        """End the process (SIGTERM, then SIGKILL after ``timeout``); return its exit code."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._log.close()
        self._dir.cleanup()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
