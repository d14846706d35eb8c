"""rdma://: tear-down under transfers that are still in the engine (issue 32, class 1).

A transfer runs on one of the engine's threads; the call that awaits it can end first (its
timeout, a closed connection) and the engine can be closed while transfers are queued or under
way. Then: no process ends, a transfer the close cancels fails with TransportError (not a stray
CancelledError in the caller's task), and the memory a transfer touches stays alive until the
engine's thread is done with it. The peer is a real engine in a child process, stopped with
SIGSTOP so that its transfers stall; the test ends it."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from tensorwire._aio import run
from tensorwire.errors import TransferTimeout, TransportError
from tensorwire.testing import rdma as kit
from tensorwire.testing.process import wait_for
from tensorwire.transport.rdma_engine import TRANSFER_THREADS, Engine, address_of

pytestmark = pytest.mark.skipif(
    kit.unavailable() is not None, reason=f"rdma:// cannot run: {kit.unavailable()}"
)
SIZE = 64 << 20  # more than the sockets buffer: a transfer to a stopped peer stalls
PEER = """
import sys, time
import numpy as np
from tensorwire.transport.rdma_engine import Engine, address_of
engine = Engine("127.0.0.1")
buf = np.zeros(int(sys.argv[1]), dtype=np.uint8)
engine.register(address_of(memoryview(buf)), buf.nbytes)
print(engine.session, address_of(memoryview(buf)), flush=True)
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def tcp_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in kit.TCP_MODE.items():
        monkeypatch.setenv(key, value)


@contextlib.contextmanager
def stopped_peer() -> Iterator[tuple[str, int, subprocess.Popen[str]]]:
    """An engine in a child process with a registered buffer of SIZE: (session, its address, the
    process). Stopped (SIGSTOP) by the test when it wants transfers to stall; killed at the end."""
    env = {**os.environ, **kit.TCP_MODE}
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(SIZE)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        session, address = proc.stdout.readline().split()
        yield session, int(address), proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def test_an_engine_closed_under_queued_and_running_transfers() -> None:
    """TRANSFER_THREADS transfers stall on a stopped peer and two more wait for a thread; the
    engine closes: the waiting two fail with TransportError at once, the stalled ones end with
    their own timeout, and the process lives on once the peer goes on."""

    async def case(session: str, remote: int, proc: subprocess.Popen[str]) -> None:
        engine = Engine("127.0.0.1")
        src = np.full(SIZE, 7, dtype=np.uint8)
        await engine.write(session, address_of(src.data), remote, 4096, timeout=10.0, keep=src)
        os.kill(proc.pid, signal.SIGSTOP)
        tasks = [
            asyncio.ensure_future(engine.write(session, address_of(src.data), remote, SIZE, timeout=2.0))
            for _ in range(TRANSFER_THREADS + 2)
        ]
        await asyncio.to_thread(wait_for, lambda: engine._pool._work_queue.qsize() == 2, 10, "two queued")
        engine.close()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert sum(isinstance(d, TransferTimeout) for d in done) == TRANSFER_THREADS, done
        assert sum(type(d) is TransportError for d in done) == 2, done
        with pytest.raises(TransportError, match="closed"):
            await engine.write(session, address_of(src.data), remote, 4096, timeout=2.0)
        os.kill(proc.pid, signal.SIGCONT)  # the stalled transfers go on, on the closed engine's threads
        await asyncio.sleep(0.5)

    with stopped_peer() as (session, remote, proc):
        run(case(session, remote, proc))


def test_a_buffer_lives_until_the_engine_is_done_with_it() -> None:
    """A read into a buffer times out while the engine's thread still writes into it; the caller
    drops the buffer; it stays alive (the engine holds it) until the thread returns."""

    async def case(session: str, remote: int, proc: subprocess.Popen[str]) -> weakref.ref[np.ndarray]:
        engine = Engine("127.0.0.1")
        dest = np.zeros(SIZE, dtype=np.uint8)
        await engine.read(session, address_of(dest.data), remote, 4096, timeout=10.0, keep=dest)
        os.kill(proc.pid, signal.SIGSTOP)
        with pytest.raises(TransferTimeout):
            await engine.read(session, address_of(dest.data), remote, SIZE, timeout=1.0, keep=dest)
        alive = weakref.ref(dest)
        del dest
        gc.collect()
        assert alive() is not None, "the buffer was freed while the engine still wrote into it"
        os.kill(proc.pid, signal.SIGCONT)
        await asyncio.to_thread(
            wait_for, lambda: gc.collect() is not None and alive() is None, 30, "the read"
        )
        engine.close()
        return alive

    with stopped_peer() as (session, remote, proc):
        assert run(case(session, remote, proc))() is None
