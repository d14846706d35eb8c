"""No shared-memory segment outlives its owner: a client killed with SIGKILL in the middle of a put
leaves nothing visible and nothing reserved, and the segments of a server killed with SIGKILL are
removed when the next server starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from tensorwire import connect
from tensorwire.errors import CapacityExceeded
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.types import MiB

SHM = Path("/dev/shm")

# A client that puts one tensor, then stops in the middle of a second put: segments handed out,
# half the bytes written, no SHM_COMMIT. It names the segment in MARKER and waits to be killed.
MID_PUT = """
import asyncio, pathlib, sys, torch
from tensorwire.client import AsyncClient
from tensorwire.types import TensorMeta
from tensorwire.wire import meta as wm, shm as ws
from tensorwire.wire.frame import Opcode

async def main(url, marker):
    client = AsyncClient(url)
    await client.put("done", torch.ones(1 << 18))
    t = await client._open()
    meta = TensorMeta("half", torch.float32, (1 << 20,), 4 << 20)
    reader = await t.call(Opcode.SHM_PUT, wm.encode_records([meta]), what="a put")
    reader.u64()
    (ref,) = ws.decode_refs(reader, 1)
    segment = t.maps.get(ref.segment, writable=True)
    segment[ws.HEADER_BYTES : ws.HEADER_BYTES + (2 << 20)] = bytes(2 << 20)
    pathlib.Path(marker + ".part").write_text(ref.segment)
    pathlib.Path(marker + ".part").rename(marker)  # whole, or not there: the test polls for it
    await asyncio.sleep(600)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def files(prefix: str) -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(prefix)}


def _fits(url: str) -> bool:
    """Whether 59 MiB more fit in the 64 MiB store: only once the killed put's 4 MiB are freed."""
    with connect(url) as c:
        try:
            c.put("big", torch.zeros(59 * MiB // 4))
        except CapacityExceeded:
            return False
        return True


def test_sigkill_of_a_client_mid_put_and_of_the_server_leaks_no_segment(tmp_path: Path) -> None:
    marker = tmp_path / "mid-put"
    with ServerProcess("shm://127.0.0.1:0", capacity="64MiB") as srv:
        prefix = f"tensorwire-{srv.pid}-"
        client = subprocess.Popen([sys.executable, "-c", MID_PUT, srv.url, str(marker)])
        try:
            wait_for(lambda: marker.exists() or client.poll() is not None, 60, "the client to be mid-put")
        finally:
            client.send_signal(signal.SIGKILL)
            client.wait(10)
        assert marker.exists(), f"the client exited with {client.returncode} before its put"
        assert marker.read_text() in files(prefix)
        wait_for(lambda: _fits(srv.url), 10, "the killed client's reservation to be freed")
        with connect(srv.url) as c:
            assert sorted(m.name for m in c.list()) == ["big", "done"]  # never "half"
        srv.signal(signal.SIGKILL)
        srv.proc.wait(10)
        left = files(prefix)
        assert len(left) >= 3, left  # two tensors and the probe: what the next start must clean
    with ServerProcess("shm://127.0.0.1:0", capacity="64MiB") as srv2:
        assert not files(prefix), "the next server did not remove a dead server's segments"
        with connect(srv2.url) as c:
            c.put("x", torch.ones(1 << 18))
        prefix2 = f"tensorwire-{srv2.pid}-"
        assert files(prefix2)
        assert srv2.stop() == 0
    assert not files(prefix2), "a server stopped with SIGTERM left segments behind"
