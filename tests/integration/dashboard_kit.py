"""Running ``tensorwire dashboard`` as a child process for the dashboard tests: started with
``--port 0``, its URL read from the line it prints (within a deadline), stopped with SIGTERM."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from collections.abc import Sequence
from types import TracebackType


class DashboardProcess:
    """``tensorwire dashboard SERVERS... --port 0`` in a child process; ``url`` is its page."""

    def __init__(
        self, servers: Sequence[str], extra: Sequence[str] = (), start_timeout: float = 30.0
    ) -> None:
        cmd = [sys.executable, "-m", "tensorwire.cli", "dashboard", *servers, "--port", "0", *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        self.lines: list[str] = []
        try:
            self.url = self._wait_for_url(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_for_url(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not sel.select(deadline - time.monotonic()):
                    break
                line = self.proc.stdout.readline().decode(errors="replace")
                if not line:
                    raise RuntimeError(f"the dashboard exited: {''.join(self.lines)}")
                self.lines.append(line)
                if line.startswith("tensorwire dashboard on "):
                    return line.split(" on ", 1)[1].strip()
        raise TimeoutError(f"the dashboard printed no URL within {timeout}s: {''.join(self.lines)}")

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> DashboardProcess:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
