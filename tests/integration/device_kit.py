"""A stand-in for a CUDA device, for the staging pipeline's tests on the CPU.

``LateCopier`` is a ``client.staging.Copier`` whose copies run late, in order, on a thread of their
own (a stream's DMA engine): a copy poisons its destination at once (0xFF bytes: NaN floats, as a
transfer under way leaves it) and reads its source only when it runs. So each mistake the pipeline
could make shows up in the numbers: a piece sent before its copy completed (NaN on the server), a
host buffer reused before the copy reading it completed (the copy reads the new bytes), parameters
read before the training thread waited for their copy (NaN in the forward pass).

``gate(n, event)`` holds copy ``n`` until ``event`` is set, to pin down an order: a pipeline that
waited for something it must not wait for deadlocks instead, and the test's deadline fails it.
``log`` records what happened, in order: ``("start", n)``, ``("done", n)``, ``("waited", n)`` (a
wait on the event loop returned), ``("compute_waits", n)`` (called by the training thread) and
``("compute_waited", n)``, ``("mark", n)``, ``("after_compute", -1)``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

import torch

from tensorwire.ps import ParamServer
from tensorwire.server import ServerThread

DEADLINE = 60.0


@contextlib.contextmanager
def cluster(servers: int) -> Iterator[list[str]]:
    """``servers`` parameter servers in threads of this process, closed on exit: their URLs."""
    threads = [ServerThread(extensions=[ParamServer(60.0)]) for _ in range(servers)]
    try:
        yield [t.url for t in threads]
    finally:
        for t in threads:
            t.close()


class _Handle(concurrent.futures.Future[None]):
    number = -1


class LateCopier:
    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.log: list[tuple[str, int]] = []
        self.gates: dict[int, threading.Event] = {}
        self.first_wait = threading.Event()  # set when a wait on the event loop first returns
        self._numbers = itertools.count()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="late-copier")

    def gate(self, number: int, event: threading.Event) -> None:
        self.gates[number] = event

    def _submit(self, number: int, work: object) -> _Handle:
        handle = _Handle()
        handle.number = number

        def run() -> None:
            gate = self.gates.get(number)
            if gate is not None and not gate.wait(DEADLINE):
                handle.set_exception(TimeoutError(f"copy {number} was held past the deadline"))
                return
            if self.delay:
                time.sleep(self.delay)
            try:
                work()  # type: ignore[operator]
            except BaseException as exc:
                handle.set_exception(exc)
                return
            handle.set_result(None)

        self._pool.submit(run)
        return handle

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        number = next(self._numbers)
        dst.view(torch.uint8).fill_(0xFF)
        self.log.append(("start", number))

        def work() -> None:
            dst.copy_(src)
            self.log.append(("done", number))

        return self._submit(number, work)

    async def wait(self, handle: object) -> None:
        if handle is None:
            return
        assert isinstance(handle, _Handle)
        await asyncio.wait_for(asyncio.wrap_future(handle), DEADLINE)
        self.log.append(("waited", handle.number))
        self.first_wait.set()

    def after_compute(self) -> None:
        self.log.append(("after_compute", -1))

    def mark(self) -> object:
        number = next(self._numbers)
        return self._submit(number, lambda: self.log.append(("mark", number)))

    def compute_waits(self, handle: object) -> None:
        assert isinstance(handle, _Handle)
        self.log.append(("compute_waits", handle.number))
        handle.result(DEADLINE)  # the host stands in for the training thread's stream
        self.log.append(("compute_waited", handle.number))

    def inside(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def pending(self) -> int:
        """Copies started and not done."""
        started = {n for what, n in self.log if what == "start"}
        return len(started - {n for what, n in self.log if what == "done"})

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
