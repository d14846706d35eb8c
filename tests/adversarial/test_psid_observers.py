"""Readers outside a job (observers: ``ps.pull_parameters``, an evaluation process) cannot make the
job's own workers' pulls wait. Before: every copy of the parameters a slow reader still sent from
counted against the four a pull may wait for, so four observers that read nothing (a stalled
evaluation job, or a hostile one) held four versions, and the workers' next pull after a step
waited for them until its timeout."""

from __future__ import annotations

import threading

import torch

from tensorwire import transport as transports
from tensorwire._aio import run
from tensorwire.errors import TensorwireError, WaitTimeout
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.server.snapshots import MAX_OBSERVER_SNAPSHOTS, MAX_SNAPSHOTS
from tensorwire.server import ServerThread
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode
from tensorwire.wire.tensors import byte_view

# 32 MiB of parameters: more than loopback's socket buffers hold, so a reader that reads nothing
# keeps the server's send (and the copy it sends from) in flight.
ROWS, COLS = 2048, 4096


class StuckObserver:
    """An observer's PS_PULL whose answer it never reads: its client stops at the records (the
    first bytes of the answer) until ``release``."""

    def __init__(self, url: str, job: str, keys: list[str]) -> None:
        self.landed = threading.Event()  # the server started sending it a copy
        self.failed: BaseException | None = None
        self.done = threading.Event()
        self._release = threading.Event()
        body = wps.PsHead(wps.OBSERVER, 1, 0, 0, 300, job).encode() + wm.encode_names(keys)
        self._thread = threading.Thread(target=self._pull, args=(url, body), daemon=True)
        self._thread.start()

    def _pull(self, url: str, body: bytes) -> None:
        def land(metas: list[TensorMeta]) -> list[memoryview]:
            self.landed.set()
            self._release.wait(60)  # this client's loop reads nothing more until released
            return [byte_view(torch.empty(m.nbytes, dtype=torch.uint8)) for m in metas]

        async def go() -> None:
            conn = await transports.open_transport(Address.parse(url), transports.TransportOptions(5, 60))
            try:
                assert isinstance(conn, FramedTransport)
                await conn.call(Opcode.PS_PULL, body, [], land, what="a stuck observer's pull")
            finally:
                await conn.close()

        try:
            run(go())
        except TensorwireError as exc:
            self.failed = exc
        finally:
            self.done.set()

    def started(self) -> bool:
        """Wait until the server sends to it, or refused it (False)."""
        while not self.landed.wait(0.05):
            if self.done.is_set():
                return False
        return True

    def stop(self) -> None:
        self._release.set()
        self._thread.join(30)


def test_observers_that_read_nothing_do_not_hold_the_workers_pulls() -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(COLS, ROWS, bias=False)
    observers: list[StuckObserver] = []
    with (
        ServerThread(extensions=[ParamServer(wait_timeout=3)]) as server,
        Worker(net, server.url, "async", SGD(lr=0.1), rank=0, world_size=1, heartbeat=0, timeout=3) as worker,
    ):
        keys = [s.key for s in worker.placement.on_server(0)]
        try:
            for _ in range(MAX_SNAPSHOTS + 2):
                observer = StuckObserver(server.url, worker.job, keys)
                observers.append(observer)
                observer.started()
                net.weight.grad = torch.ones_like(net.weight)
                worker.step()  # a new version, and a pull of it: never waits on the observers
            sending = [o for o in observers if o.landed.is_set()]
            refused = [o for o in observers if not o.landed.is_set()]
            assert len(sending) == MAX_OBSERVER_SNAPSHOTS
            for observer in refused:  # the observers beyond waited (their own wait), not the workers
                assert isinstance(observer.failed, WaitTimeout), observer.failed
                assert "copies observers read" in str(observer.failed)
            assert worker.version == MAX_SNAPSHOTS + 2
        finally:
            for observer in observers:
                observer.stop()
