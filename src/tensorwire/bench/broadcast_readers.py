"""The processes of ``tensorwire bench broadcast`` (broadcast.py has the harness and the modes):
the state_dict they move, the publisher, and the readers.

A reader (``python -m tensorwire.bench.broadcast_readers --reader INDEX FOLDER``, inside its
namespace where there is one) is started once for the whole run. It waits for ``FOLDER/spec.json``
(the origin's URL, the state_dict's layout, the timeout), then for each round's ``job`` in
``FOLDER/round-<n>/`` (the reader way, by name, and how many readers take part). A reader taking
part allocates and touches its tensors, sets its way up (connects), touches ``ready-<i>``, waits
for ``go``, fetches (timed, wall clock, so that the readers' spans compare across processes),
hashes each tensor and writes ``result-<i>``. It exits when ``FOLDER/stop`` appears or its parent
is gone (a reader started again after a kill begins at ``--first-round``). A reader way is a
context manager in ``READERS``: ``origin`` and ``delta`` read with the client, ``relay`` and
``mixed`` with a ``Subscriber`` that keeps serving the readers after it until the round's ``over``.

The publisher (``--publish SPEC OUT``) makes the state_dict from the spec's seed, publishes it on
the origin as a generation of ``PREFIX`` (``publish``) and writes each tensor's digest to OUT. With
``changed`` = k in the spec it publishes the state_dict after k rounds of ``change`` (1% of the
elements of every tensor given new values at random positions, seeded): the generation a
``delta`` round reads against the one before. The publisher loop (``--publish-loop SPEC OUT``,
the ``mixed`` mode's) publishes generation after generation, each tensor's bytes tagged with the
generation (``fill``), appending each one's number and digests to OUT until the spec's ``stop``.

A round's job may name the generation to read (``at``) and the one the reader holds (``base``):
the ``delta`` way reads ``base`` in full before the go, then ``at`` with ``base=``, and reports
the bytes its client received (``DeltaStats``) with its result.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import xxhash

from tensorwire.broadcast import Subscriber
from tensorwire.client import connect
from tensorwire.errors import TensorwireError, TransferTimeout
from tensorwire.server.process import wait_for

PREFIX = "model"  # the generations' prefix: a tensor ``name`` is read as ``model/name``
CHANGED_SHARE = 0.01  # of each tensor's elements, given new values in each published change
START_TIMEOUT = 120.0  # a process imports torch and allocates the model first; a loaded 2-core box
STOP_TIMEOUT = 10.0  # for a process told to stop (or killed) to exit
GO_POLL = 0.002  # how often a ready reader looks for the go (its start is at most this late)
IDLE_POLL = 0.02  # how often an idle reader looks for its next round


# -- the state_dict ---------------------------------------------------------------------------------
Layout = list[tuple[str, torch.dtype, tuple[int, ...]]]


def layout(size: int, tensors: int) -> Layout:
    """A transformer-like state_dict of about ``size`` bytes in about ``tensors`` tensors: L layers
    of 9 (q, k, v, o of d x d, gate and up of 4d x d, down of d x 4d, all bf16, and two fp32
    norms), a bf16 embedding and an fp32 output head of 8d x d each, and an fp32 final norm. The
    width d (a multiple of 8) is the largest that keeps the whole within ``size``."""
    layers = max(1, round((tensors - 3) / 9))
    per_d2 = 32 * layers + 2 * 8 + 4 * 8  # bytes per d*d: the layers, embedding, head
    per_d = 4 * (2 * layers + 1)  # the norms
    d = max(8, int((-per_d + math.sqrt(per_d**2 + 4 * per_d2 * size)) / (2 * per_d2)) // 8 * 8)
    bf, f32 = torch.bfloat16, torch.float32
    out: Layout = [("embed.weight", bf, (8 * d, d))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + f"attn.{x}.weight", bf, (d, d)) for x in "qkvo"]
        out += [(p + "mlp.gate.weight", bf, (4 * d, d)), (p + "mlp.up.weight", bf, (4 * d, d)),
                (p + "mlp.down.weight", bf, (d, 4 * d)), (p + "norm1.weight", f32, (d,)),
                (p + "norm2.weight", f32, (d,))]  # fmt: skip
    return [*out, ("norm.weight", f32, (d,)), ("lm_head.weight", f32, (8 * d, d))]


def model_bytes(lay: Layout) -> int:
    return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in lay)


def make_state_dict(lay: Layout, seed: int) -> dict[str, torch.Tensor]:
    """The published values: normal noise from ``seed`` (what the readers' hashes are checked against)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, dtype, shape in lay}


def empty_state_dict(lay: Layout) -> dict[str, torch.Tensor]:
    """A reader's tensors, allocated and touched before the go, as a model's parameters would be."""
    return {name: torch.zeros(shape, dtype=dtype) for name, dtype, shape in lay}


def digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's bytes hashed (xxh3-128): what a reader got is compared with what was published."""
    return {
        name: xxhash.xxh3_128_hexdigest(t.view(-1).view(torch.uint8).numpy().data)
        for name, t in tensors.items()
    }


def change(tensors: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A copy in which ``CHANGED_SHARE`` of each tensor's elements have new (normal) values, at
    random positions from ``seed``: a new generation that differs from the last in 1% of its elements."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        flat = t.clone().view(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[: max(1, int(flat.numel() * CHANGED_SHARE))]
        flat[idx] = torch.randn(idx.numel(), generator=gen).to(t.dtype)
        out[name] = flat.view(t.shape)
    return out


def publish(url: str, tensors: Mapping[str, torch.Tensor], timeout: float) -> int:
    """Make ``tensors`` readable on the origin: the next generation of ``PREFIX`` (its number)."""
    with connect(url, timeout=timeout) as client:
        return client.publish(PREFIX, dict(tensors)).number


def full_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors by the names they are read under (``model/name``), the same tensor objects."""
    return {f"{PREFIX}/{name}": t for name, t in tensors.items()}


# -- the reader processes ---------------------------------------------------------------------------
Spec = dict[str, Any]
Fetch = Callable[[], dict[str, Any] | None]  # what it returns goes into the reader's result
# A reader way: given the spec, this reader's index and its preallocated tensors, it sets up
# (connects), yields the one call that fills the tensors, and tears down.
ReaderWay = Callable[[Spec, int, dict[str, torch.Tensor]], AbstractContextManager[Fetch]]


@contextlib.contextmanager
def from_origin(spec: Spec, index: int, tensors: dict[str, torch.Tensor]) -> Iterator[Fetch]:
    """Everything from the origin in one ``get_many`` into the reader's own tensors."""
    with connect(spec["origin"], timeout=spec["timeout"]) as client:
        out = full_names(tensors)
        names = list(out)

        def fetch() -> None:
            client.get_many(names, out=out, at=spec.get("at", "latest"))

        yield fetch


@contextlib.contextmanager
def delta_from_origin(spec: Spec, index: int, tensors: dict[str, torch.Tensor]) -> Iterator[Fetch]:
    """Generation ``base`` in full before the go (untimed), then generation ``at`` as deltas
    against it (``base=``), applied in place: what a reader one generation behind does."""
    with connect(spec["origin"], timeout=spec["timeout"]) as client:
        out = full_names(tensors)
        names = list(out)
        client.get_many(names, out=out, at=spec["base"])

        def fetch() -> dict[str, Any]:
            client.get_many(names, out=out, at=spec["at"], base=spec["base"])
            stats = client.delta_stats
            return {"wire_bytes": stats.wire_bytes, "delta_chunks": stats.delta_chunks,
                    "full_chunks": stats.full_chunks, "refetched": stats.refetched}  # fmt: skip

        yield fetch


@contextlib.contextmanager
def through_relay(spec: Spec, index: int, tensors: dict[str, torch.Tensor]) -> Iterator[Fetch]:
    """The newest generation through the relay (a ``Subscriber``, its relay server on this
    namespace's address so the readers after it reach it). It keeps serving until the round is
    ``over``: a reader done early is still the upstream of the readers after it.

    With a ``victim`` in the job, the victim stops pulling after its first verified chunk (a
    process frozen mid-relay) and says so (``progress-<i>``); only then do the others join, so the
    origin strings them behind it, and each says when its first chunk has landed (``progress-<i>``):
    the harness kills the victim once one of them is pulling from it. They report how many readers
    the origin has routed around (RELAY_STATS ``dropped``) once done."""
    folder = Path(spec["round"])
    victim: int | None = spec.get("victim")
    first = functools.partial(_first_chunk, folder, index)
    progress = functools.partial(_frozen, folder, index, spec["timeout"]) if victim == index else first
    with Subscriber(spec["origin"], PREFIX, tensors, timeout=spec["timeout"], progress=progress) as sub:

        def fetch() -> dict[str, Any]:
            if victim is None or victim == index:
                return {"generation": sub.update()}
            what = f"reader {victim}'s first chunk"
            wait_for(marker(folder, "progress", victim).exists, spec["timeout"], what, GO_POLL)
            number = sub.update()
            relay = next(g for g in sub.stats()["generations"] if g["generation"] == number)
            return {"generation": number, "dropped": relay["dropped"]}  # routed around, so far

        yield fetch
        _wait_over(folder, spec["timeout"])


@contextlib.contextmanager
def relay_while_publishing(spec: Spec, index: int, tensors: dict[str, torch.Tensor]) -> Iterator[Fetch]:
    """For ``mixed_seconds`` after the go, every new generation through the relay as the publisher
    makes them (``wait_and_update``); each read's generation, its tensors' digests and the tags in
    their heads (``tag``) are reported, for the harness to check against what was published."""
    folder = Path(spec["round"])
    with Subscriber(spec["origin"], PREFIX, tensors, timeout=spec["timeout"]) as sub:

        def fetch() -> dict[str, Any]:
            reads: list[dict[str, Any]] = []
            failed: list[str] = []
            end = time.monotonic() + spec["mixed_seconds"]
            while time.monotonic() < end:
                try:
                    number = sub.wait_and_update(max(end - time.monotonic(), 0.1))
                except TransferTimeout:
                    break  # no new generation before the end
                except TensorwireError as exc:  # refused by the Subscriber's own checks, or retired
                    failed.append(f"{type(exc).__name__}: {exc}")
                    continue
                held = {"generation": number, "digests": digests(tensors), "tags": sorted(tags(tensors))}
                reads.append(held)
            return {"reads": reads, "failed": failed}

        yield fetch
        _wait_over(folder, spec["timeout"])


def _frozen(folder: Path, index: int, timeout: float, chunks: int) -> None:
    """The victim's progress: after its first verified chunk it says so and stops pulling (the
    Subscriber calls this on its pull path) until it is killed, or the round is over."""
    if chunks >= 1:
        marker(folder, "progress", index).touch()
        _wait_over(folder, timeout)


def _first_chunk(folder: Path, index: int, chunks: int) -> None:
    path = marker(folder, "progress", index)
    if chunks >= 1 and not path.exists():
        path.touch()


def _wait_over(folder: Path, timeout: float) -> None:
    wait_for((folder / "over").exists, timeout, "the end of the round", IDLE_POLL)


READERS: dict[str, ReaderWay] = {
    "origin": from_origin,
    "delta": delta_from_origin,
    "relay": through_relay,
    "mixed": relay_while_publishing,
}


def reader_main(index: int, folder: Path, first_round: int = 1) -> None:
    """One reader process (inside its namespace), for every round of the run: it waits for
    ``spec.json``, then for each round's ``job`` (the reader way and how many readers take part),
    takes part in it if its index is among them, and exits once the harness writes ``stop`` (or
    is gone)."""
    torch.set_num_threads(1)
    idle = functools.partial(_idle_until, stop=folder / "stop", parent=os.getppid())
    spec_path = folder / "spec.json"
    if not idle(spec_path, timeout=2 * START_TIMEOUT):  # the origin starts meanwhile
        return
    spec = json.loads(spec_path.read_text())
    for number in itertools.count(first_round):
        job_path = round_folder(folder, number) / "job"
        if not idle(job_path, timeout=START_TIMEOUT + spec["timeout"]):
            return
        job = json.loads(job_path.read_text())
        if index < job["count"]:
            read_once(job["way"], {**spec, **job}, index, job_path.parent)


def read_once(way: str, spec: Spec, index: int, folder: Path) -> None:
    """One round: allocate (and touch) the tensors, set up, say ready, wait for the go, fetch
    (timed), hash, write ``result-<index>``, tear down (a relay way waits for the round's ``over``)."""
    tensors = empty_state_dict(_layout_from(spec["layout"]))
    with READERS[way]({**spec, "round": str(folder)}, index, tensors) as fetch:
        marker(folder, "ready", index).touch()
        wait_for((folder / "go").exists, spec["timeout"], "the go signal", GO_POLL)
        start, cpu = time.time(), time.process_time()  # wall clock: compared across processes
        info = fetch()
        end, cpu = time.time(), time.process_time() - cpu  # all its threads: pull, verify, relay
        result = {"start": start, "end": end, "cpu": cpu, "digests": digests(tensors), "info": info or {}}
        write_json(marker(folder, "result", index), result)


def _idle_until(path: Path, *, stop: Path, parent: int, timeout: float) -> bool:
    """Wait for ``path``: True once it is there, False once ``stop`` is (the harness is done)."""

    def there() -> bool:
        if os.getppid() != parent:  # orphaned: the harness died without saying stop
            raise SystemExit(f"the harness (pid {parent}) is gone")
        return path.exists() or stop.exists()

    wait_for(there, timeout, str(path), IDLE_POLL)
    return path.exists()


def publisher_main(spec_path: Path, out: Path) -> None:
    """Make the state_dict (``changed`` times changed), publish it on the origin, write its digests
    and generation number to ``out``."""
    spec = json.loads(spec_path.read_text())
    tensors = make_state_dict(_layout_from(spec["layout"]), spec["seed"])
    for k in range(spec.get("changed", 0)):
        tensors = change(tensors, spec["seed"] + 1 + k)
    number = publish(spec["origin"], tensors, spec["timeout"])
    write_json(out, {"generation": number, "digests": digests(tensors)})


def publisher_loop_main(spec_path: Path, out: Path) -> None:
    """Publish generation after generation (every ``every`` seconds at most) until ``stop``
    appears: the k-th has every tensor's bytes set to k (mod 251, plus 1) and k in its first 8
    bytes (``tag``), so that a read mixing two generations shows. Each one's number and digests
    are appended to ``out`` (JSON lines) once published."""
    spec = json.loads(spec_path.read_text())
    tensors = empty_state_dict(_layout_from(spec["layout"]))
    stop = Path(spec["stop"])
    with connect(spec["origin"], timeout=spec["timeout"]) as client, open(out, "a") as log:
        for k in itertools.count(1):
            started = time.monotonic()
            fill(tensors, k)
            number = client.publish(PREFIX, dict(tensors)).number
            log.write(json.dumps({"generation": number, "tag": k, "digests": digests(tensors)}) + "\n")
            log.flush()
            if _paused(stop, started + spec["every"]):
                return


def _paused(stop: Path, until: float) -> bool:
    """Wait until ``until`` (the publisher's pace) or ``stop``, whichever comes first: stopped?"""
    while time.monotonic() < until and not stop.exists():
        time.sleep(IDLE_POLL)
    return stop.exists()


def fill(tensors: Mapping[str, torch.Tensor], k: int) -> None:
    """Every byte ``k % 251 + 1``, then ``k`` in each tensor's first 8 bytes (those of 8 or more)."""
    for t in tensors.values():
        raw = t.view(-1).view(torch.uint8)
        raw.fill_(k % 251 + 1)
        if raw.numel() >= 8:
            raw[:8].view(torch.int64)[0] = k


def tags(tensors: Mapping[str, torch.Tensor]) -> set[int]:
    """The ``k`` in the heads of the tensors (``fill``): one value unless a read mixed generations."""
    heads = [t.view(-1).view(torch.uint8)[:8] for t in tensors.values() if t.nbytes >= 8]
    return {int(head.view(torch.int64)[0]) for head in heads}


def round_folder(folder: Path, number: int) -> Path:
    return folder / f"round-{number}"


def marker(folder: Path, what: str, index: int) -> Path:
    """A reader's files in its round's folder: ``ready-<i>`` (set up, waiting for the go) and
    ``result-<i>`` (its times and digests, JSON)."""
    return folder / f"{what}-{index}"


def write_json(path: Path, value: object) -> None:
    """Whole or not at all (a rename): the other side polls for the file and reads it at once."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(value))
    part.rename(path)


def _layout_from(rows: list[list[Any]]) -> Layout:
    return [(name, getattr(torch, dtype), tuple(shape)) for name, dtype, shape in rows]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tensorwire.bench.broadcast_readers")
    parser.add_argument("--reader", nargs=2, metavar=("INDEX", "FOLDER"))
    parser.add_argument("--publish", nargs=2, metavar=("SPEC", "OUT"))
    parser.add_argument("--publish-loop", nargs=2, metavar=("SPEC", "OUT"))
    parser.add_argument("--first-round", type=int, default=1, help="a reader started again after a kill")
    args = parser.parse_args(argv)
    if args.publish:
        publisher_main(Path(args.publish[0]), Path(args.publish[1]))
    if args.publish_loop:
        publisher_loop_main(Path(args.publish_loop[0]), Path(args.publish_loop[1]))
    if args.reader:
        reader_main(int(args.reader[0]), Path(args.reader[1]), args.first_round)
        sys.stdout.flush()
        os._exit(0)  # skip the interpreter's teardown with torch loaded (~0.4 s; children.py)


if __name__ == "__main__":
    main()
