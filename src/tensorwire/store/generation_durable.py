"""The data directory's side of a store's generations (store/generations.py owns one ``Durable``
when the store has a ``--data-dir``; generation_disk.py writes and reads the files).

* ``publish``: a generation is numbered, written (on the store's disk thread; one publish at a time,
  so numbers and files agree) and only then made visible: once a publish has returned, its
  generation survives a kill -9. A publish given up during its write (its connection closed, the
  server stopping) leaves nothing on disk (generation_disk.py ``Ticket``): a publisher told it
  failed never finds its generation back after a restart.
* ``remove_later`` / ``remove_prefix``: the files of what retention or a drop took out of memory;
  a removal that fails is logged and counted (``disk_errors``): what stays is retired again at the
  next start.
* ``restore``: at start, every generation of the data directory back in memory, numbered as it was
  published and checked against the root digest recorded with it. Restoring is not publishing: the
  bounds a client's publish is admitted under do not apply (an operator who lowers a bound gets no
  new prefix until there is room, never a server that cannot start). A generation that cannot be
  restored (damaged, or a prefix that nests with another's) is set aside (generation_disk.py
  ``quarantine``), logged and counted (``quarantined``), and the server starts with the rest; only
  one that cannot be moved aside, or generations beyond ``--capacity``, stop the start, naming the
  directory.

Called from the server's event loop (and, for ``restore``, before any loop runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from tensorwire.errors import CapacityExceeded, PersistenceError, TensorwireError
from tensorwire.logs import event
from tensorwire.store.generation_disk import GenerationDisk, StoredGeneration, Ticket
from tensorwire.store.memory import Reservation
from tensorwire.types import Generation, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire.names import validate_name

if TYPE_CHECKING:
    from tensorwire.store.generations import Generations, Kept, Sums

log = logging.getLogger("tensorwire.store.generations")


class Durable:
    """The generations of ``gens`` in the data directory ``disk`` (see the module docstring)."""

    def __init__(self, gens: Generations, disk: GenerationDisk) -> None:
        self.gens, self.disk = gens, disk
        self.disk_errors = 0  # generations whose files could not be removed (logged)
        self.quarantined = 0  # generations of the data directory set aside at start (logged)
        self._removals: set[asyncio.Task[None]] = set()
        self._writing: asyncio.Lock | None = None  # made on the loop that first writes

    @property
    def writing(self) -> asyncio.Lock:
        """Held while a generation is written or a prefix's files removed: one at a time."""
        if self._writing is None:
            self._writing = asyncio.Lock()
        return self._writing

    # -- publishing ----------------------------------------------------------------------------
    async def publish(
        self, prefix: str, res: Reservation, sums: Sums, number: int, client: str | None
    ) -> Generation:
        """``res`` published as the prefix's next generation, written first: PersistenceError, and
        nothing visible, if it cannot be."""
        gens, store = self.gens, self.gens.store
        try:
            await self.writing.acquire()  # numbers are handed out and written in the same order
        except BaseException:
            store.abort(res)  # cancelled while another publish was being written
            raise
        try:
            kept = gens.prepare(prefix, res, sums, number, client=client)
            await self._write(kept)
            kept.durable = True
            try:
                return gens.install(kept, client)
            except Exception:  # refused after all (a bound reached meanwhile): its files go too,
                # before the next publish (which may take the same number) is written
                with contextlib.suppress(PersistenceError):
                    await store.call(self.disk.remove, prefix, kept.generation.number)
                raise
        finally:
            self.writing.release()

    async def _write(self, kept: Kept) -> None:
        gen, disk = kept.generation, self.disk
        pairs = [kept.tensors[name] for name in gen.names]
        ticket = Ticket()
        write = asyncio.ensure_future(self.gens.store.call(disk.write, gen, pairs, ticket))
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            # Given up (its connection closed, the server stops): its publisher hears it failed, so
            # the generation must not come back at the next start. The disk thread stops before
            # the rename; had it renamed it already, it goes now (on this thread: the server may be
            # stopping, and a removal queued behind it might never run). The disk thread still
            # reads the buffers: they go back to the pool once it is done.
            if ticket.abandon():
                self._remove_abandoned(gen)
            write.add_done_callback(functools.partial(self._abandoned, kept))
            raise
        except BaseException as exc:
            self.gens.discard(kept)
            if isinstance(exc, PersistenceError):
                what = f"generation {gen.number} of {gen.prefix!r}"
                raise PersistenceError(f"{what} not published: {exc}") from exc
            raise

    def _abandoned(self, kept: Kept, write: asyncio.Future[None]) -> None:
        """The disk thread is done with a generation whose publish was given up: its buffers go
        (the write's outcome is nobody's now: it stopped short, or was removed)."""
        if not write.cancelled():
            write.exception()  # retrieved: asyncio would log it as lost
        self.gens.discard(kept)

    def _remove_abandoned(self, gen: Generation) -> None:
        try:
            self.disk.remove(gen.prefix, gen.number)
        except PersistenceError as exc:
            self.disk_errors += 1
            event(log, logging.ERROR, "a generation whose publish was given up is left on disk; it is"
                  " restored at the next start unless removed", prefix=gen.prefix, number=gen.number,
                  error=str(exc))  # fmt: skip

    # -- removing ------------------------------------------------------------------------------
    async def remove_prefix(self, prefix: str) -> None:
        """Every file of ``prefix``, removed before this returns (a drop; ``writing`` held)."""
        await self.gens.store.call(self.disk.remove_prefix, prefix)

    def remove_later(self, fn: Callable[..., None], *args: object) -> None:
        """``fn(*args)`` (``disk.remove``, ``disk.remove_prefix``) on the store's disk thread, after
        every write queued before (at start, before any loop runs: at once). A failure is logged and
        counted: the files of a retired generation that stay are retired again at the next start."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            with contextlib.suppress(PersistenceError):
                fn(*args)
            return
        task = loop.create_task(self.gens.store.call(fn, *args))
        self._removals.add(task)
        task.add_done_callback(self._removed)

    def _removed(self, task: asyncio.Task[None]) -> None:
        self._removals.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.disk_errors += 1
            event(log, logging.WARNING, "retired generation left on disk", error=str(task.exception()))

    # -- at start ------------------------------------------------------------------------------
    def restore(self) -> None:
        """Every generation of the data directory back in memory, as it was published (what cannot
        be is set aside); then each prefix keeps its last ``keep`` (files of generations retired
        before a crash go now)."""
        gens = self.gens
        for stored in self.disk.load(self._set_aside):
            try:
                self._restore(stored)
            except CapacityExceeded:  # an operator's setting (--capacity, --max-tensors), not the data
                raise
            except TensorwireError as exc:  # damaged, or never publishable (a name, a nesting)
                self._set_aside(stored.path, exc)
        for prefix in gens.prefixes():
            gens.retire(prefix)
        if len(gens):
            event(log, logging.INFO, "generations restored", prefixes=len(gens), generations=gens.generations,
                  bytes=gens.store.kept)  # fmt: skip

    def _set_aside(self, path: pathlib.Path, why: Exception) -> None:
        """What cannot be restored goes under the quarantine folder, loudly (PersistenceError
        naming it where it cannot be moved: the one case the server does not start)."""
        moved = self.disk.quarantine(path)
        self.quarantined += 1
        event(log, logging.ERROR, "generation set aside: it cannot be restored", path=str(path),
              moved_to=str(moved), reason=str(why))  # fmt: skip

    def _restore(self, stored: StoredGeneration) -> None:
        """One generation of the data directory back as it was kept: checked (a valid prefix, not
        nesting with another, its root digest as recorded), never admitted as a client's publish
        is (no quota of a client's applies: the module docstring)."""
        gens, store = self.gens, self.gens.store
        validate_name(stored.prefix)
        gens.check_nesting(stored.prefix, "restored before it")
        metas = [TensorMeta(m.name, m.dtype, m.shape, m.nbytes) for m, _ in stored.tensors]
        try:
            res = store.reserve(metas)
        except CapacityExceeded as exc:  # the server does not start: say which directory to remove
            where = f"restoring generation {stored.number} of {stored.prefix!r} from {stored.path}"
            raise CapacityExceeded(f"{exc}; {where} (remove it to start without it)") from exc
        try:
            wg.check_names(stored.prefix, [m.name for m in metas])
            for buffer, (_, data) in zip(res.buffers, stored.tensors, strict=True):
                buffer.cast("B")[:] = data.numpy().data.cast("B")
            sums = [wg.chunk_checksums(b) for b in res.buffers]
        except BaseException:
            store.abort(res)
            raise
        kept = gens.numbered(stored.prefix, res, sums, stored.number)
        gen = kept.generation
        if gen.number != stored.number or gen.digest != stored.digest:
            gens.discard(kept)
            raise PersistenceError(
                f"generation {stored.number} of {stored.prefix!r} in the data directory does not read"
                " back as it was published (its root digest differs): the files are damaged"
            )
        kept.durable = True
        gens.installed(kept)
