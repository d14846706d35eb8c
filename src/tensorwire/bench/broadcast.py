"""One origin, many readers: what it costs to bring a model's state_dict to N processes (issue 17).

The topology: an origin namespace running a ``tensorwire serve`` store and N reader namespaces
(``bench/netns.py``), each link shaped to ``--rate`` Gb/s both ways (tc tbf), every reader a
process of its own. The state_dict is ``--size`` bytes in ``--tensors`` tensors laid out like a
transformer's (``layout``: bf16 projections and embedding, an fp32 output head and norms), made
from a seed and published on the origin by a publisher process inside the origin's namespace (on
loopback, by this process) as generation 1 of the prefix ``model`` (``client.publish``).

Each measurement is a *mode*: a function in ``MODES`` that takes the ``Harness`` (the origin's URL,
the reader processes, the origin's byte counter) and returns its keys. The readers are started
once, with the origin, one process per reader namespace; a mode runs a round of them
(``Harness.run_readers(way, count)``) with a *reader way* from ``READERS``, chosen by name in the
round's job: every reader taking part fills preallocated (and touched) tensors between a common
go and its end, then hashes each tensor; the harness compares every reader's hashes with the
published ones and fails the bench on any difference. A new mode is a function in ``MODES`` and,
where its readers do something new (receive from the relay, say), a reader way in ``READERS``
(``broadcast_readers.py``: the state_dict, the publisher and the reader processes).
The modes measured today:

* ``single``: one reader fetches the whole state_dict from the origin with ``get_many(out=...)``:
  ``single_s``.
* ``star``: N readers at once, each from the origin: ``star_s``, ``star_vs_single`` (~N when the
  origin's link is the bound).
* ``delta``: the next generation is published, in which 1% of the elements of every tensor have
  new values at random positions (bf16 and fp32, seeded); one reader that holds the previous one
  reads it with ``base=`` (deltas per chunk, applied in place): ``delta_s``, ``delta_bytes`` and
  ``delta_bytes_ratio`` (/ model bytes; target <= 0.05), with ``delta_bytes_source`` saying what
  counted them: the origin's link (veth tx bytes, TCP/IP headers included) in namespaces, the
  reader client's ``DeltaStats.wire_bytes`` (answer data, no frame headers) on loopback.

Every mode also gives ``bound_s[mode]`` (the physical bound: model bytes / link rate, N times that
for star, all of it through the origin's link) and, in namespaces, ``origin_egress_bytes[mode]``
and ``origin_egress_ratio[mode]`` (bytes the origin's link sent, from its veth counters, / model
bytes; TCP/IP headers make 1.0 about 1.05). Modes that need code not built yet (the relay's
``fanout``, ``mixed``, ``killed``) are listed in ``not_measured`` with the reason, never
given a number.

Where namespaces cannot be made the bench exits 0 with ``skipped`` and the reason. ``--no-netns``
runs the same modes on 127.0.0.1 without shaping (``"network": "loopback"``; every process shares
this machine's cores, so the figures are CPU-bound, and there is no origin link to count).

Run: ``tensorwire bench broadcast [--json] [--readers 8] [--size 256MiB] [--rate 1] [--no-netns]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensorwire.bench.broadcast_readers import (
    CHANGED_SHARE,
    START_TIMEOUT,
    Layout,
    layout,
    marker,
    model_bytes,
    publisher_main,
    round_folder,
    write_json,
)
from tensorwire.bench.netns import Fabric, Unavailable
from tensorwire.bench.report import show, table
from tensorwire.bench.transfer import parse_size
from tensorwire.server.process import ServerProcess, wait_for
from tensorwire.types import MiB

ORIGIN_PORT = 7070  # the origin has a namespace, so an address, of its own
STOP_TIMEOUT = 10.0
# What comes later in issue 17, and why it has no number yet.
NOT_BUILT = {
    "fanout": "the relay (readers forwarding chunks to each other) is not built yet",
    "mixed": "a publisher publishing while readers read is not measured yet",
    "killed": "the relay, which a killed reader would have to be routed around, is not built yet",
}


@dataclass(frozen=True)
class Setup:
    readers: int = 8
    size: int = 256 * MiB
    rate_gbit: float = 1.0
    tensors: int = 75  # 8 layers of 9 tensors, the embedding, the final norm, the output head
    seed: int = 0
    timeout: float = 300.0  # for one mode's readers, once started
    netns: bool = True
    modes: tuple[str, ...] = ("single", "star", "delta")


# -- the harness ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Round:
    """What one mode's readers did: the span from the first start to the last end, each reader's
    own time, the bytes the origin's link sent meanwhile (None on loopback), and what each reader
    reported beside its bytes (its way's ``info``)."""

    seconds: float
    reader_s: list[float]
    egress: int | None
    info: list[dict[str, Any]] = field(default_factory=list)


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

    def next_generation(self) -> int:
        """Publish the state_dict once more changed (``broadcast_readers.change``); its number."""
        if self.publish_next is None:
            raise RuntimeError("this harness has no publisher")
        published = self.publish_next(self.generation)
        self.generation, self.expected = published["generation"], published["digests"]
        return self.generation

    def run_readers(self, way: str, count: int, **job: Any) -> Round:
        """Readers 0..count-1 set up ``way`` (``job`` is passed to it: ``at``, ``base``), go
        together once all are ready; every reader's bytes are checked against the newest
        generation; the round's times and the origin's egress are returned."""
        if count > len(self.procs):
            raise ValueError(f"{count} readers asked of a harness of {len(self.procs)}")
        self.rounds += 1
        folder = round_folder(self.folder, self.rounds)
        folder.mkdir()
        write_json(folder / "job", {"at": self.generation, **job, "way": way, "count": count})
        self._wait(folder, "ready", count, START_TIMEOUT, f"{count} {way} readers to set up")
        before = self.egress() if self.egress else 0
        (folder / "go").touch()
        self._wait(folder, "result", count, self.setup.timeout, f"{count} {way} readers to finish")
        sent = self.egress() - before if self.egress else None
        results = [json.loads(marker(folder, "result", i).read_text()) for i in range(count)]
        self._check(way, results)
        span = max(r["end"] for r in results) - min(r["start"] for r in results)
        return Round(span, [r["end"] - r["start"] for r in results], sent, [r["info"] for r in results])

    def _wait(self, folder: Path, what: str, count: int, timeout: float, label: str) -> None:
        def there() -> bool:
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    tail = (self.folder / f"reader-{i}.log").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"reader {i} exited with {proc.returncode}:\n{tail}")
            return all(marker(folder, what, i).exists() for i in range(count))

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
            cmd = [*wrapper, sys.executable, "-m", "tensorwire.bench.broadcast_readers",
                   "--reader", str(i), str(folder)]  # fmt: skip
            with open(folder / f"reader-{i}.log", "wb") as log:  # a file: a pipe nobody reads can fill up
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        yield procs
    finally:
        (folder / "stop").touch()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_TIMEOUT)
            if proc.poll() is None:
                proc.kill()
                proc.wait(STOP_TIMEOUT)


# -- the modes --------------------------------------------------------------------------------------
Mode = Callable[[Harness], dict[str, Any]]


def single(h: Harness) -> dict[str, Any]:
    """One reader fetches the whole state_dict from the origin."""
    r = h.run_readers("origin", 1)
    return {"single_s": r.seconds, **_per_mode(h, "single", r, copies=1)}


def star(h: Harness) -> dict[str, Any]:
    """Every reader at once, each from the origin: the origin's link carries N copies."""
    r = h.run_readers("origin", h.setup.readers)
    return {"star_s": r.seconds, "star_reader_s": r.reader_s, **_per_mode(h, "star", r, h.setup.readers)}


def delta(h: Harness) -> dict[str, Any]:
    """The next generation (1% of every tensor's elements changed) read by one reader that holds
    the previous one, as per-chunk deltas: the bytes that moved, / the model's."""
    base = h.generation
    at = h.next_generation()
    r = h.run_readers("delta", 1, at=at, base=base)
    info = r.info[0]
    moved, source = (
        info["wire_bytes"],
        "client DeltaStats.wire_bytes (answer data bytes; no frame or TCP headers)",
    )
    if r.egress is not None:
        moved, source = (
            r.egress,
            "origin egress (veth tx bytes of the origin's link, TCP/IP headers included)",
        )
    return {
        "delta_s": r.seconds,
        "delta_bytes": moved,
        "delta_bytes_ratio": moved / h.model_bytes,
        "delta_bytes_source": source,
        "delta_changed_share": CHANGED_SHARE,
        "delta_chunks": {k: info[k] for k in ("delta_chunks", "full_chunks", "refetched")},
    }


MODES: dict[str, Mode] = {"single": single, "star": star, "delta": delta}


def _per_mode(h: Harness, mode: str, r: Round, copies: int) -> dict[str, Any]:
    """The keys every mode has, as ``{key: {mode: value}}``: the physical bound (``copies`` model
    copies through the origin's link) and, in namespaces, what the origin's link sent."""
    if not h.setup.netns:
        return {}
    link = h.setup.rate_gbit * 1e9 / 8  # bytes/s
    out: dict[str, Any] = {"bound_s": {mode: copies * h.model_bytes / link}}
    if r.egress is not None:
        out["origin_egress_bytes"] = {mode: r.egress}
        out["origin_egress_ratio"] = {mode: r.egress / h.model_bytes}
        out["origin_link_use"] = {mode: r.egress / r.seconds / link}  # well under 1: not link-bound
    return out


# -- the run ----------------------------------------------------------------------------------------
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
        capacity = str(2 * size + 64 * MiB)
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
            return _run_publisher(origin_wrap, folder, setup.timeout, f"spec-{changed}.json")

        first = _run_publisher(origin_wrap, folder, setup.timeout, "spec.json")
        yield Harness(setup, server.url, folder, procs, first["digests"], size, egress,
                      generation=first["generation"], publish_next=publish_next)  # fmt: skip


def _run_publisher(wrapper: Sequence[str], folder: Path, timeout: float, spec: str) -> dict[str, Any]:
    """The publisher runs where the origin does: in its namespace, a process of its own (its put
    crosses no shaped link); on loopback, this process (it has torch imported already). Returns
    the generation's number and digests."""
    out, log = folder / f"published-{spec}", folder / "publisher.log"
    if not wrapper:
        publisher_main(folder / spec, out)
        return dict(json.loads(out.read_text()))
    cmd = [*wrapper, sys.executable, "-m", "tensorwire.bench.broadcast_readers", "--publish",
           str(folder / spec), str(out)]  # fmt: skip
    with open(log, "wb") as sink:
        done = subprocess.run(
            cmd, check=False, stdout=sink, stderr=subprocess.STDOUT, timeout=START_TIMEOUT + timeout
        )
    if done.returncode != 0:
        raise RuntimeError(f"the publisher exited with {done.returncode}:\n{log.read_text()[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run(setup: Setup) -> dict[str, Any]:
    lay = layout(setup.size, setup.tensors)
    size = model_bytes(lay)
    result: dict[str, Any] = {
        "network": "netns" if setup.netns else "loopback (127.0.0.1, unshaped: all processes share the CPUs)",
        "readers": setup.readers,
        "model_bytes": size,
        "tensors": len(lay),
        "bytes_by_dtype": _bytes_by_dtype(lay),
        "modes": list(setup.modes),
    }
    if setup.netns:
        result.update(rate_gbit=setup.rate_gbit, link_s=size * 8 / (setup.rate_gbit * 1e9))
    started = time.monotonic()
    try:
        with harness(setup, lay) as h:
            for mode in setup.modes:
                for key, value in MODES[mode](h).items():
                    if isinstance(value, dict):  # a {mode: value} key that several modes add to
                        result.setdefault(key, {}).update(value)
                    else:
                        result[key] = value
    except Unavailable as exc:
        result["skipped"] = f"network namespaces are not available here: {exc}"
        return result
    if "single_s" in result and "star_s" in result:
        result["star_vs_single"] = result["star_s"] / result["single_s"]
    if result.get("origin_link_use"):
        result["rate_note"] = _rate_note(result["origin_link_use"])
    result["not_measured"] = _not_measured(setup)
    result["seconds"] = time.monotonic() - started
    return result


def _rate_note(use: dict[str, float]) -> str:
    """Whether the links or this machine's CPUs bounded the run: a link busy less than 80% of a
    mode's time means the processes could not keep up with it (then lower ``--rate``)."""
    low = min(use, key=use.__getitem__)
    if use[low] < 0.8:
        return (f"the origin's link was only {use[low]:.0%} busy in {low}: the CPUs, not the link, "
                "bounded it; measure at a lower --rate")  # fmt: skip
    return f"the origin's link was at least {use[low]:.0%} busy in every mode: the link bounded them"


def _bytes_by_dtype(lay: Layout) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, dtype, shape in lay:
        key = str(dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + math.prod(shape) * dtype.itemsize
    return out


def _not_measured(setup: Setup) -> dict[str, str]:
    out = {mode: reason for mode, reason in NOT_BUILT.items() if mode not in MODES}
    if not setup.netns:
        out["origin_egress"] = "loopback: the origin has no link of its own whose bytes could be counted"
        out["bound_s"] = "loopback: no link rate to bound the transfer"
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    d = Setup()
    parser = argparse.ArgumentParser(prog="tensorwire bench broadcast", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--readers", type=int, default=d.readers, help="reader processes (star)")
    parser.add_argument("--size", type=parse_size, default=d.size, help="the state_dict's bytes, about")
    parser.add_argument("--tensors", type=int, default=d.tensors, help="how many tensors, about")
    parser.add_argument("--rate", type=float, default=d.rate_gbit, help="namespaces: link speed in Gb/s")
    parser.add_argument("--modes", default=",".join(d.modes), help=f"of {', '.join(MODES)}")
    parser.add_argument("--timeout", type=float, default=d.timeout, help="seconds for each mode's readers")
    parser.add_argument("--no-netns", dest="netns", action="store_false",
                        help="on 127.0.0.1, unshaped (labelled loopback in the result)")  # fmt: skip
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; measured today: {', '.join(MODES)}")
    if args.readers < 1 or args.tensors < 1:
        parser.error("--readers and --tensors must be at least 1")
    setup = Setup(args.readers, args.size, args.rate, args.tensors, timeout=args.timeout,
                  netns=args.netns, modes=modes)  # fmt: skip
    return show(run(setup), args.json, _readable)


def _readable(r: dict[str, Any]) -> str:
    links = f", {r['rate_gbit']} Gb/s links" if "rate_gbit" in r else ""
    head = (f"broadcast: {r['model_bytes'] / 1e6:.0f} MB in {r['tensors']} tensors to {r['readers']} "
            f"readers, {r['network']}{links}")  # fmt: skip
    if "skipped" in r:
        return table(head, [("skipped", "", r["skipped"])], 8)
    rows = []
    for mode in r["modes"]:
        bound = r.get("bound_s", {}).get(mode)
        ratio = r.get("origin_egress_ratio", {}).get(mode)
        note = (f"bound {bound:.2f} s" if bound else "") + (
            f", origin sent {ratio:.2f} x the model" if ratio else ""
        )
        if mode == "delta":
            note = f"{r['delta_bytes_ratio']:.4f} x the model's bytes (target <= 0.05)"
        rows.append((mode, f"{r[f'{mode}_s']:.2f} s", note))
    if "star_vs_single" in r:
        rows.append(("star / single", f"{r['star_vs_single']:.2f}", ""))
    rows += [(mode, "not measured", why) for mode, why in r.get("not_measured", {}).items()]
    return table(head, rows, 8)


if __name__ == "__main__":
    main()
