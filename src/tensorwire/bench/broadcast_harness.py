"""The harness of ``tensorwire bench broadcast`` (bench/broadcast.py, which says what it measures):
the origin started in its namespace (or on loopback), the state_dict published on it, the reader
processes started once and run in rounds.

A round (``Harness.run_readers``, or ``start_round`` then ``finish_round`` for a mode that acts in
between) writes the job into a folder of its own, waits until every reader taking part is ready,
gives the go, waits for each reader's result and checks its bytes against the newest published
generation (``WrongBytes``: the bench fails rather than report a time). Files in the folders are
the only channel to the readers (bench/broadcast_readers.py), so a reader in another network
namespace needs nothing but the shared temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorwire.bench.broadcast_publishers import run_publisher
from tensorwire.bench.broadcast_readers import (
    START_TIMEOUT,
    STOP_TIMEOUT,
    Layout,
    marker,
    model_bytes,
    round_folder,
    write_json,
)
from tensorwire.bench.netns import Fabric
from tensorwire.server.process import ServerProcess, wait_for
from tensorwire.types import MiB

ORIGIN_PORT = 7070  # the origin has a namespace, so an address, of its own


@dataclass(frozen=True)
class Setup:
    """What the bench was asked (``main``'s options): its readers, the model, the links, the modes."""

    readers: int = 8
    size: int = 256 * MiB
    rate_gbit: float = 1.0
    tensors: int = 75  # 8 layers of 9 tensors, the embedding, the final norm, the output head
    seed: int = 0
    timeout: float = 300.0  # for one mode's readers, once started
    netns: bool = True
    modes: tuple[str, ...] = ("single", "star", "delta", "fanout", "mixed", "killed")
    mixed_seconds: float = 30.0
    publish_every: float | None = None  # mixed: seconds between publishes (None: the link time)


# -- the rounds ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Round:
    """What one mode's readers did: the span from the first start to the last end, each reader's
    own time, the bytes the origin's link sent meanwhile (None on loopback), and what each reader
    reported beside its bytes (its way's ``info``)."""

    seconds: float
    reader_s: list[float]
    egress: int | None
    info: list[dict[str, Any]] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)  # each reader's CPU seconds (all its threads)


@dataclass(frozen=True)
class Started:
    """A round under way: its reader way, its folder, the origin link's sent bytes at the go."""

    way: str
    folder: Path
    egress: int


@dataclass
class Harness:
    """The origin and the reader processes, for the modes: ``run_readers`` is all a mode needs.
    The readers are started once, with the origin (they import torch meanwhile), and take part in
    each round that asks for them."""

    setup: Setup
    origin: str  # the origin's URL, as the readers reach it
    folder: Path
    procs: list[subprocess.Popen[bytes]]  # reader i, in its namespace
    expected: dict[str, str]  # the newest generation's digests
    model_bytes: int
    egress: Callable[[], int] | None = None  # bytes the origin's link has sent so far
    rounds: int = field(default=0)
    generation: int = 1  # the newest published
    publish_next: Callable[[int], dict[str, Any]] | None = None  # publishes the k-th change
    origin_wrapper: Sequence[str] = ()  # runs a command in the origin's namespace
    spec: dict[str, Any] = field(default_factory=dict)  # what the readers and publishers were given
    restart: Callable[[int, int], None] | None = None  # reader i started again (killed), from round r
    killed: set[int] = field(default_factory=set)  # readers a mode killed, started again when needed

    def next_generation(self) -> int:
        """Publish the state_dict once more changed (``broadcast_readers.change``); its number."""
        if self.publish_next is None:
            raise RuntimeError("this harness has no publisher")
        published = self.publish_next(self.generation)
        self.generation, self.expected = published["generation"], published["digests"]
        return self.generation

    def run_readers(self, way: str, count: int, *, check: bool = True, **job: Any) -> Round:
        """Readers 0..count-1 set up ``way`` (``job`` is passed to it: ``at``, ``base``), go
        together once all are ready; every reader's bytes are checked against the newest
        generation (unless ``check`` is false: the mode checks them); the round's times and the
        origin's egress are returned."""
        started = self.start_round(way, count, **job)
        try:
            return self.finish_round(started, range(count), check)
        finally:
            (started.folder / "over").touch()

    def start_round(self, way: str, count: int, **job: Any) -> Started:
        """The first half of ``run_readers``: the job written, the readers ready, the go given."""
        if count > len(self.procs):
            raise ValueError(f"{count} readers asked of a harness of {len(self.procs)}")
        self.rounds += 1
        for i in sorted(self.killed & set(range(count))):
            if self.restart is None:
                raise RuntimeError(f"reader {i} was killed and this harness cannot start it again")
            self.procs[i].wait(STOP_TIMEOUT)
            self.restart(i, self.rounds)
            self.killed.discard(i)
        folder = round_folder(self.folder, self.rounds)
        folder.mkdir()
        write_json(folder / "job", {"at": self.generation, **job, "way": way, "count": count})
        self.wait(folder, "ready", range(count), START_TIMEOUT, f"{count} {way} readers to set up")
        before = self.egress() if self.egress else 0
        (folder / "go").touch()
        return Started(way, folder, before)

    def finish_round(self, started: Started, readers: Sequence[int], check: bool = True) -> Round:
        """The second half: the results of ``readers`` awaited (and checked), the round measured.
        The caller says the round is ``over`` (the relay's readers serve until then)."""
        way, folder = started.way, started.folder
        self.wait(folder, "result", readers, self.setup.timeout, f"{len(readers)} {way} readers to finish")
        sent = self.egress() - started.egress if self.egress else None
        results = [json.loads(marker(folder, "result", i).read_text()) for i in readers]
        if check:
            self._check(way, results)
        span = max(r["end"] for r in results) - min(r["start"] for r in results)
        times = [r["end"] - r["start"] for r in results]
        return Round(span, times, sent, [r["info"] for r in results], [r["cpu"] for r in results])

    def wait(
        self, folder: Path, what: str, readers: Sequence[int], timeout: float, label: str, *, least: int = 0
    ) -> None:
        """Until each of ``readers`` (``least`` of them, if given) has written ``what`` in
        ``folder``; RuntimeError with its log's tail if one of them exits meanwhile."""

        def there() -> bool:
            for i in readers:
                proc = self.procs[i]
                if proc.poll() is not None:
                    tail = (self.folder / f"reader-{i}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"reader {i} exited with {proc.returncode}:\n{tail}")
            return sum(marker(folder, what, i).exists() for i in readers) >= (least or len(readers))

        wait_for(there, timeout, label, 0.005)

    def _check(self, way: str, results: list[dict[str, Any]]) -> None:
        for i, result in enumerate(results):
            wrong = sorted(n for n, d in self.expected.items() if result["digests"].get(n) != d)
            if wrong:
                raise WrongBytes(f"{way} reader {i} got different bytes than were published in "
                                 f"{len(wrong)} tensors: {', '.join(wrong[:5])}")  # fmt: skip


class WrongBytes(RuntimeError):
    """A reader's tensors differ from the published ones: the bench fails rather than report a time."""


@contextlib.contextmanager
def readers(wrappers: Sequence[Sequence[str]], folder: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """The reader processes, one per wrapper (namespace); on leaving, told to stop (``stop`` in
    ``folder``, which may have been written already), then any still running after
    ``STOP_TIMEOUT`` killed."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, wrapper in enumerate(wrappers):
            procs.append(start_reader(wrapper, i, folder))
        yield procs
    finally:
        (folder / "stop").touch()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_TIMEOUT)
            if proc.poll() is None:
                proc.kill()
                proc.wait(STOP_TIMEOUT)


def start_reader(
    wrapper: Sequence[str], index: int, folder: Path, first_round: int = 1
) -> subprocess.Popen[bytes]:
    """Reader ``index`` in its namespace, taking part in rounds from ``first_round`` on."""
    cmd = [*wrapper, sys.executable, "-m", "tensorwire.bench.broadcast_readers",
           "--reader", str(index), str(folder), "--first-round", str(first_round)]  # fmt: skip
    with open(folder / f"reader-{index}.log", "ab") as log:  # a file: a pipe nobody reads can fill up
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


# -- the origin, published -----------------------------------------------------------------------
@contextlib.contextmanager
def harness(setup: Setup, lay: Layout) -> Iterator[Harness]:
    """The origin started (in its namespace, or on loopback), the state_dict published on it, the
    readers' places: all of it gone on leaving."""
    with tempfile.TemporaryDirectory(prefix="tensorwire-broadcast-") as tmp, contextlib.ExitStack() as stack:
        n, size, folder = setup.readers, model_bytes(lay), Path(tmp)
        egress: Callable[[], int] | None = None
        if setup.netns:
            fabric = stack.enter_context(Fabric(1 + n, int(setup.rate_gbit * 1e9) or None))
            listen, origin_wrap = f"tcp://{fabric.addresses[0]}:{ORIGIN_PORT}", fabric.wrapper(0)
            wrappers = [fabric.wrapper(1 + i) for i in range(n)]
            egress = lambda: fabric.counters(0)[0]  # noqa: E731 - what the origin's namespace sent
        else:
            listen, origin_wrap, wrappers = "tcp://127.0.0.1:0", [], [[] for _ in range(n)]
        procs = stack.enter_context(readers(wrappers, folder))  # they import torch meanwhile
        capacity = str(4 * size + 64 * MiB)  # 2 kept, 1 being published, 1 pinned by a read
        server = stack.enter_context(
            ServerProcess(listen, capacity=capacity, start_timeout=START_TIMEOUT, wrapper=origin_wrap)
        )
        stack.callback((folder / "stop").touch)  # first on leaving: readers end while the origin does
        spec = {
            "origin": server.url, "seed": setup.seed, "timeout": setup.timeout,
            "layout": [[name, str(dtype).removeprefix("torch."), list(shape)] for name, dtype, shape in lay],
        }  # fmt: skip
        write_json(folder / "spec.json", spec)

        def publish_next(changed: int) -> dict[str, Any]:
            write_json(folder / f"spec-{changed}.json", {**spec, "changed": changed})
            return run_publisher(origin_wrap, folder, setup.timeout, f"spec-{changed}.json")

        first = run_publisher(origin_wrap, folder, setup.timeout, "spec.json")

        def restart(index: int, first_round: int) -> None:
            procs[index] = start_reader(wrappers[index], index, folder, first_round)

        yield Harness(setup, server.url, folder, procs, first["digests"], size, egress,
                      generation=first["generation"], publish_next=publish_next,
                      origin_wrapper=origin_wrap, spec=spec, restart=restart)  # fmt: skip
