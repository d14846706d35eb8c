"""One server on a Ray cluster: an actor that owns one ``tensorwire serve`` process on its node.

Lifecycle, called by the driver (``tensorwire.ray.servers``) in this order:

1. ``ServerActor(host)``: the actor picks a free port on its node (``host``, default the node's
   address) and makes a private working directory; ``address()`` returns both.
2. ``start(capacity, flags, secrets, timeout)``: runs the server on that address with ``flags``
   (``--backup`` ... for a replica), the secrets written to 0600 files it reads at start and
   removed once it is up; returns its URL and pid.
3. ``stop(grace)``: SIGTERM, SIGKILL after ``grace`` s; the working directory is removed.

``ray.kill`` of the actor (or its node dying, or its owner exiting) ends the server too: the server
process is started with a parent-death signal (SIGKILL; Linux), so it never outlives the actor,
and a standby takes over as it would from a killed process. The server is started on the actor's
main thread (a plain actor runs its methods there), the thread whose exit the signal follows.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import ray

from tensorwire.ps.launch import free_port
from tensorwire.security import write_token_file
from tensorwire.server.process import ServerProcess
from tensorwire.types import Address

log = logging.getLogger(__name__)

# Run as ``python -c GUARD PARENT_PID COMMAND...``: ask for SIGKILL when the parent dies, check
# it did not die before the request (then nobody would send it), and become COMMAND (exec keeps
# the request and the pid, so stopping the server signals the server itself).
_GUARD = """\
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
    sys.exit(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
if os.getppid() != int(sys.argv[1]):
    sys.exit("the actor that started this server has exited")
os.execv(sys.argv[2], sys.argv[2:])
"""


def guard(parent: int) -> list[str]:
    """The command prefix that ties a child's life to ``parent`` (Linux only; elsewhere none, and a
    server can outlive an actor killed without ``stop``)."""
    if not sys.platform.startswith("linux"):
        log.warning("no parent-death signal on %s: a killed actor leaves its server running", sys.platform)
        return []
    return [sys.executable, "-c", _GUARD, str(parent)]


class ServerActor:
    """See the module doc. Made a Ray actor class by ``servers`` (``ray.remote(ServerActor)``)."""

    def __init__(self, host: str | None = None) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="tensorwire-ray-"))  # 0700
        # ServerProcess keeps its log and ready file in a temporary directory of its own: put it in
        # the working directory, so that one removal takes everything this actor wrote (this process
        # is the actor's alone).
        tempfile.tempdir = str(self.workdir)
        node = host or str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        self.listen = str(Address("tcp", node, free_port(node)))
        self.server: ServerProcess | None = None

    def address(self) -> tuple[str, str]:
        """The URL the server will listen on, and the working directory (to sweep after a kill)."""
        return self.listen, str(self.workdir)

    def start(
        self, capacity: str, flags: Sequence[str], secrets: Mapping[str, str], timeout: float
    ) -> tuple[str, int]:
        """Run the server; ``secrets`` maps a flag (``--token-file``) to the secret it names."""
        files = {
            flag: write_token_file(self.workdir / flag.strip("-"), value) for flag, value in secrets.items()
        }
        try:
            extra = [*flags, *(arg for flag, path in files.items() for arg in (flag, str(path)))]
            self.server = ServerProcess(
                self.listen, capacity, start_timeout=timeout, extra=extra, wrapper=guard(os.getpid())
            )
        finally:  # the server read them at start; a copy left on disk would only be a leak
            for path in files.values():
                path.unlink(missing_ok=True)
        return self.server.url, self.server.pid

    def output(self) -> str:
        """What the server printed (its log), for a test or an operator that asks why."""
        return self.server.output() if self.server is not None else ""

    def stop(self, grace: float) -> int | None:
        """End the server; its exit code (None when it never started)."""
        code = self.server.stop(grace) if self.server is not None else None
        shutil.rmtree(self.workdir, ignore_errors=True)
        return code
