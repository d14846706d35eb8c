"""Server-side shared-memory segments: the store's buffers when it serves ``shm://``.

``SegmentPool`` has the interface of ``BufferPool`` (``allocate``, ``take``, ``give``, ``trim``), so
``TensorStore`` keeps its whole put / commit / pin lifecycle and only the memory changes: a tensor
of ``min_size`` bytes or more lives in a segment of its own, a file in the shared-memory directory
that clients map; smaller ones stay in private memory and travel inside the control messages.

Segments are reused: one freed by an overwrite or a delete waits in the pool, by size class (1/8
steps per doubling), for the next put of a size in that class (a fresh segment costs ~4x a copy in
page faults). Taking one from the pool bumps its generation before anyone writes to it
(``tensorwire.wire.shm``). A segment that a view may still read after its lease was lost (the
connection holding the lease ended) is *tainted*: it is never reused, only unlinked once freed.

Names carry the owner's pid and start time; ``clean_stale`` removes the segments of owners that
are gone (a server killed with SIGKILL), and ``close`` unlinks every segment of a server that stops.

Names are predictable (a counter after the prefix), and the shared-memory directory is writable by
every local user, so a name may be taken already: each file is created with ``O_EXCL`` (which also
refuses a planted symlink), and on a collision the pool logs it and tries a random number instead,
up to ``NAME_TRIES`` names, before it gives up with ``SharedMemoryUnavailable``. A planted file
costs one retry; it never fails a put.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import mmap
import os
import secrets
from collections import defaultdict
from pathlib import Path

from tensorwire.errors import CapacityExceeded, SharedMemoryUnavailable
from tensorwire.logs import event
from tensorwire.store.pool import allocate_private
from tensorwire.types import KiB
from tensorwire.wire import shm as ws

log = logging.getLogger("tensorwire.shm")
SEGMENT_MIN_BYTES = 64 * KiB  # smaller tensors: a segment (a file, a mapping) costs more than a copy
# Names tried for one segment (the next of the counter, then random ones) before giving up: a
# random 48-bit number is taken only if someone planted that very file, so a few tries suffice.
NAME_TRIES = 16
_PAGE = mmap.PAGESIZE


class Segment:
    """One segment file, mapped read-write by the server."""

    __slots__ = ("capacity", "generation", "map", "name", "path", "tainted")

    def __init__(self, path: Path, capacity: int) -> None:
        self.path = path
        self.name = path.name
        self.capacity = capacity
        self.generation = 1
        self.tainted = False
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # only this user's processes
        try:
            # Allocate the pages now: a full /dev/shm is then an error here, not a SIGBUS later in
            # whichever process first touches a page that cannot be backed.
            os.posix_fallocate(fd, 0, ws.HEADER_BYTES + capacity)
            self.map = mmap.mmap(fd, ws.HEADER_BYTES + capacity)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise CapacityExceeded(f"{path.parent} has no room for a {capacity}-byte segment") from exc
            raise SharedMemoryUnavailable(f"cannot create a segment in {path.parent}: {exc}") from exc
        finally:
            os.close(fd)
        self.map[: ws.HEADER_BYTES] = ws.pack_head(self.generation, capacity).ljust(ws.HEADER_BYTES, b"\0")

    def data(self, nbytes: int) -> memoryview:
        return memoryview(self.map)[ws.HEADER_BYTES : ws.HEADER_BYTES + nbytes]

    def bump(self) -> None:
        """A new generation: called before new bytes are written into a reused segment."""
        self.generation += 1
        self.map[ws.GEN_OFFSET : ws.GEN_OFFSET + 8] = self.generation.to_bytes(8, "little")

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def size_class(nbytes: int) -> int:
    """The segment capacity for ``nbytes``: rounded up to 1/8 of its power of two, and to a page."""
    step = max(_PAGE, 1 << max(nbytes.bit_length() - 4, 0))
    return -(-nbytes // step) * step


class SegmentPool:
    """Segments for a store's tensors, and the free ones by size class (at most ``limit`` bytes)."""

    def __init__(self, directory: Path, limit: int, min_size: int = SEGMENT_MIN_BYTES) -> None:
        self.directory = directory
        self.limit = limit
        self.min_size = min_size
        self.held = 0
        self.fresh = 0  # bytes of new segments handed out (not reused): what costs page faults
        self.closed = False  # after close, new buffers are private memory: nobody would unlink them
        self.prefix = _new_prefix()
        self.collisions = 0  # names found taken by a file this pool did not make (see the module doc)
        self._numbers = itertools.count(1)
        self._live: dict[int, Segment] = {}  # id of the mmap -> its segment, for every segment not unlinked
        self._free: defaultdict[int, list[Segment]] = defaultdict(list)

    # -- the BufferPool interface ----------------------------------------------------------------
    def allocate(self, nbytes: int) -> memoryview:
        if nbytes < self.min_size or self.closed:
            return allocate_private(nbytes)
        self.fresh += nbytes
        segment = self._create(size_class(nbytes))
        self._live[id(segment.map)] = segment
        return segment.data(nbytes)

    def _create(self, capacity: int) -> Segment:
        """A new segment under a name nobody holds: the counter's next, then random numbers."""
        for attempt in range(NAME_TRIES):
            number = next(self._numbers) if attempt == 0 else secrets.randbits(48)
            path = self.directory / f"{self.prefix}{number}"
            try:
                return Segment(path, capacity)
            except FileExistsError:
                self._collided(path)
        raise SharedMemoryUnavailable(
            f"{NAME_TRIES} segment names in {self.directory} were all taken by files this server did not "
            f"make (another local user is planting them): cannot create a segment"
        )

    def create_probe(self, token: bytes) -> Path:
        """Write the probe file (SHM_ATTACH) under this pool's prefix; a prefix whose probe name is
        taken is replaced by a fresh one (only before any segment exists, so nothing is renamed)."""
        if self._live:
            raise RuntimeError("the probe is made before the first segment")
        for _ in range(NAME_TRIES):
            path = self.directory / f"{self.prefix}probe"
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                self._collided(path)
                self.prefix = _new_prefix()
                continue
            with contextlib.closing(os.fdopen(fd, "wb")) as f:
                f.write(token)
            return path
        raise SharedMemoryUnavailable(f"{NAME_TRIES} probe names in {self.directory} were all taken")

    def _collided(self, path: Path) -> None:
        self.collisions += 1
        event(log, logging.WARNING, "shared-memory name taken", path=str(path),
              detail="a file this server did not make; trying another name")  # fmt: skip

    def take(self, nbytes: int) -> memoryview | None:
        free = self._free.get(size_class(nbytes))
        if not free:
            return None
        segment = free.pop()
        self.held -= segment.capacity
        segment.bump()
        return segment.data(nbytes)

    def give(self, buf: memoryview) -> None:
        segment = self.segment_of(buf)
        if segment is None:
            return  # private memory: the garbage collector frees it
        if segment.tainted or self.held + segment.capacity > self.limit:
            self._retire(segment)
            return
        self._free[segment.capacity].append(segment)
        self.held += segment.capacity

    def trim(self, room: int) -> None:
        while self.held > max(room, 0) and self._free:
            size = max(self._free)
            free = self._free[size]
            self._retire(free.pop())
            self.held -= size
            if not free:
                del self._free[size]

    # -- shared memory -----------------------------------------------------------------------------
    def segment_of(self, buf: memoryview) -> Segment | None:
        """The live segment ``buf`` (a stored tensor's bytes) lies in, or None for private memory."""
        return self._live.get(id(buf.obj))

    def close(self) -> None:
        """Unlink every segment (the server stops). Mappings already made stay readable."""
        self.closed = True
        for segment in list(self._live.values()):
            segment.unlink()
        self._live.clear()
        self._free.clear()
        self.held = 0

    def _retire(self, segment: Segment) -> None:
        segment.unlink()
        self._live.pop(id(segment.map), None)


def _new_prefix() -> str:
    """``tensorwire-<pid>-<start>-<random instance>-``: the names of one pool's files."""
    pid = os.getpid()
    return f"{ws.PREFIX}{pid}-{process_start(pid)}-{secrets.token_hex(4)}-"


def process_start(pid: int) -> int:
    """When ``pid`` started, in clock ticks since boot (with the pid, it names one process for good:
    pids are reused, start times of one pid are not); -1 if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the command name may hold spaces


def clean_stale(directory: Path) -> list[str]:
    """Unlink the segments and probes whose owner process is gone; return their names."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = ws.NAME.fullmatch(name)
        if match is None:
            continue
        pid, start = int(match[1]), int(match[2])
        if process_start(pid) == start:
            continue  # its owner lives
        with contextlib.suppress(OSError):  # gone already, or another user's (sticky /dev/shm)
            os.unlink(directory / name)
            removed.append(name)
    if removed:
        log.info("removed %d segments left in %s by servers that are gone", len(removed), directory)
    return removed
