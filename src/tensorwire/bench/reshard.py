"""Sharded state from 4 ranks into 2 and back: tensorwire against ``torch.distributed.checkpoint``.

A state dict of ``--size`` bytes (512 MiB: 8 float32 tensors of ``--rows`` rows) is held by two
gloo worlds of spawned processes at once: 4 ranks sharding every tensor by rows (``Shard(0)``)
and 2 ranks sharding it by columns (``Shard(1)``). Each way goes 4 -> 2 -> 4:

* tensorwire (``tw_s``): the 4 ranks ``put_state_dict`` into one tensorwire server (a thread of
  this process), the 2 ranks ``load_state_dict`` it (each reads only the byte ranges of the saved
  parts that overlap its columns: one per row of each part), then the 2 put and the 4 get.
* torch.distributed.checkpoint (``dcp_s``): ``dcp.save`` from the 4 into a fresh directory under
  /dev/shm (tmpfs: memory, no disk), ``dcp.load`` into the 2, then the 2 save and the 4 load.
* torch.distributed.checkpoint through ``tensorwire.dcp`` (``dcp_tw_save_s``, ``dcp_tw_load_s``):
  the same ``dcp.save`` from the 4 and ``dcp.load`` into the 2, DCP's own planners, with the
  ``StorageWriter``/``StorageReader`` of the same server in place of files (each rank keeps one of
  each; every save a new checkpoint id, dropped after its load). ``dcp_tw_vs_tmpfs`` = their sum
  over DCP's own save4 + load2 on tmpfs (target <= 0.7): what a DCP user gains by changing only the
  storage. One untimed round first (``dcp_tw_cold_s``).

Each phase is timed between two barriers of its world and every read is checked against the
values the state was filled with. What is timed is the steady state of a job that checkpoints every
N steps: ``--warmup`` untimed rounds of each way run first (by default the server's
``--keep-generations`` + 1, the rounds after which a new generation lands in the memory of one the
server retired, as it does for such a job from its third checkpoint on, rather than in fresh pages,
which cost several times a copy here; dcp gets one, as each of its saves writes new files anyway).
The first round is reported on its own, never hidden:
``tw_cold_s`` and ``dcp_cold_s`` (and ``tw_cold_phases``), a job's first checkpoint.
``tw_vs_dcp`` = tw_s / dcp_s (target <= 0.5), both steady. ``fresh_bytes``: the bytes of new
buffers the server took during the timed tensorwire rounds (per round; 0 when every generation
reused retired memory). ``bytes_moved``: the data bytes the server received and sent during
tensorwire's phases (its own counters), and over shm:// the bytes the ranks' connections copied
into and out of its segments (their ``segment_bytes``: the bytes no socket carries);
``overlap_bytes``: what the layouts force to move (every part a rank saves, and for each reading
rank, its overlap with each saved part); ``moved_vs_overlap`` (target <= 1.01). ``socket_gbps``:
one plain socket stream between two processes, measured in the same run, and ``tw_bound_s`` =
bytes_moved over it. ``async_blocking_ratio``: what a training-like loop on the 4 ranks waits in
``AsyncSaver.save`` (the snapshot; buffers already made by an earlier save) over what a
synchronous ``put_state_dict`` of the same state takes (target <= 0.1); the snapshot's upload runs
while the loop goes on (``async_commit_s``: from the call to the committed generation).

``--transport``: how the ranks reach the server. ``shm`` is the default because it is what a user
whose ranks and server share one host uses (as the ranks and the dcp files here do): the client
copies each shard once into the server's pages and reads each overlap once out of them, with no
socket between. ``tcp`` measures the path ranks on other hosts take (every byte through a socket).

Run: ``tensorwire bench reshard [--json] [--size 512MiB] [--rows 256] [--repeats 1] [--warmup N]
[--transport shm]``.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tensorwire.bench import ps_comm
from tensorwire.bench.children import Child, spawned
from tensorwire.bench.report import show, table
from tensorwire.bench.reshard_ranks import HOST, Place, Setup, World, rank_main
from tensorwire.bench.transfer import parse_size
from tensorwire.client import connect
from tensorwire.dcp.connection import DEFAULT_NAMESPACE as DCP_NAMESPACE
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.types import MiB

SAVERS = World("savers", 4, 0)  # the 4 ranks, Shard(0)
READERS = World("readers", 2, 1)  # the 2 ranks, Shard(1)
TMPFS = Path("/dev/shm")
SOCKET_BYTES = 256 * MiB
PREFIXES = ("reshard/from4", "reshard/from2")
TRANSPORTS = ("tcp", "shm")


@dataclass
class Worlds:
    """The running ranks of both worlds and the server they share."""

    savers: list[Child]
    readers: list[Child]
    server: ServerThread
    timeout: float

    def ask(self, ranks: list[Child], *request: object) -> list[dict[str, Any]]:
        """One collective request to every rank of a world at once; their answers in rank order."""
        for child in ranks:
            child.tell(request)
        return [_answer(child, self.timeout) for child in ranks]

    def drop(self, prefix: str) -> None:
        """Every generation of ``prefix`` dropped (over the server's tcp:// listener)."""
        tcp = next(a for a in self.server.addresses if a.scheme == "tcp")
        with connect(str(tcp), timeout=self.timeout) as client:
            client.drop_generations(prefix)

    def moved(self) -> int:
        """Data bytes the server has received and sent so far (all operations)."""
        rows = list(self.server.server.counts.rows.values())
        return sum(row.received + row.sent for row in rows)

    def fresh(self) -> int:
        """Bytes of new (never reused) buffers the server's store has taken so far."""
        return self.server.server.store.pool.fresh

    @property
    def keep(self) -> int:
        return self.server.server.generations.config.keep


def _answer(child: Child, timeout: float) -> dict[str, Any]:
    answer = child.answer(timeout)
    assert isinstance(answer, dict)
    return answer


@contextlib.contextmanager
def worlds(setup: Setup) -> Iterator[Worlds]:
    """Both worlds' ranks started (in parallel) against one server; all gone on leaving."""
    capacity = 9 * setup.nbytes + 64 * MiB  # 3 prefixes x 2 kept, a put in flight, a DCP checkpoint
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
    listen = [f"{setup.transport}://{HOST}:0"]
    if setup.transport != "tcp":  # this process drops the DCP checkpoints (shm:// serves no GEN_DROP)
        listen.append(f"tcp://{HOST}:0")
    with ServerThread(listen, store=TensorStore(capacity)) as server, spawned() as children:
        for world in (SAVERS, READERS):
            places = [Place(world, r, store.port, server.url) for r in range(world.size)]
            children += [Child(rank_main, place, setup) for place in places]
        for child in children:
            child.ready(setup.timeout)
        yield Worlds(children[: SAVERS.size], children[SAVERS.size :], server, setup.timeout)


def _slowest(answers: list[dict[str, Any]], key: str = "s") -> float:
    return max(float(a[key]) for a in answers)


def tensorwire_round(w: Worlds) -> dict[str, float]:
    """4 -> 2 -> 4 through the server: each phase's seconds and the bytes it moved."""
    phases: dict[str, float] = {}
    steps: tuple[tuple[str, list[Child], str, str], ...] = (
        ("put4", w.savers, "tw_put", PREFIXES[0]),
        ("get2", w.readers, "tw_get", PREFIXES[0]),
        ("put2", w.readers, "tw_put", PREFIXES[1]),
        ("get4", w.savers, "tw_get", PREFIXES[1]),
    )
    for phase, ranks, op, prefix in steps:
        before, fresh = w.moved(), w.fresh()
        answers = w.ask(ranks, op, prefix)
        phases[f"{phase}_s"] = _slowest(answers)
        copied = sum(int(a["copied"]) for a in answers)  # through shm:// segments: no socket saw them
        phases[f"{phase}_bytes"] = w.moved() - before + copied
        phases[f"{phase}_fresh"] = w.fresh() - fresh
    return phases


def dcp_round(w: Worlds) -> dict[str, float]:
    """4 -> 2 -> 4 through torch.distributed.checkpoint files on tmpfs: each phase's seconds."""
    root = Path(tempfile.mkdtemp(prefix="tensorwire-reshard-", dir=TMPFS if TMPFS.is_dir() else None))
    try:
        there, back = str(root / "from4"), str(root / "from2")
        return {
            "save4_s": _slowest(w.ask(w.savers, "dcp_save", there)),
            "load2_s": _slowest(w.ask(w.readers, "dcp_load", there)),
            "save2_s": _slowest(w.ask(w.readers, "dcp_save", back)),
            "load4_s": _slowest(w.ask(w.savers, "dcp_load", back)),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def dcp_tw_round(w: Worlds, number: int) -> dict[str, float]:
    """4 -> 2 through DCP with tensorwire.dcp's storage: save and load seconds; then dropped."""
    checkpoint_id = f"reshard/dcp-{number}"
    save = _slowest(w.ask(w.savers, "dcp_tw_save", checkpoint_id))
    load = _slowest(w.ask(w.readers, "dcp_tw_load", checkpoint_id))
    w.drop(f"{DCP_NAMESPACE}/{checkpoint_id}")  # its memory back to the server's pool
    return {"save4_s": save, "load2_s": load}


def overlap_bytes(setup: Setup) -> int:
    """What the layouts force to move in one round: each put sends every part once, and each get
    reads, for every reading rank, its overlap with every saved part."""
    rows, cols = setup.shape
    per_tensor = 0
    for saved, read in ((SAVERS, READERS), (READERS, SAVERS)):
        per_tensor += rows * cols * 4  # the put: every part, once
        for reader in range(read.size):
            mine = _box((rows, cols), read, reader)
            per_tensor += sum(_overlap(mine, _box((rows, cols), saved, s)) for s in range(saved.size)) * 4
    return setup.tensors * per_tensor


Box = tuple[tuple[int, int], tuple[int, int]]  # (start, stop) of the rows, of the columns


def _box(shape: tuple[int, int], world: World, rank: int) -> Box:
    per = shape[world.dim] // world.size
    part = (rank * per, (rank + 1) * per)
    return (part, (0, shape[1])) if world.dim == 0 else ((0, shape[0]), part)


def _overlap(a: Box, b: Box) -> int:
    count = 1
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        count *= max(0, min(a1, b1) - max(a0, b0))
    return count


def _median_phases(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {key: float(statistics.median(r[key] for r in rounds)) for key in rounds[0]}


Rounds = tuple[dict[str, float], dict[str, float], list[dict[str, Any]]]  # tw and dcp phases, async saves


def run(setup: Setup, repeats: int = 1, warmup: int | None = None) -> dict[str, Any]:
    """``warmup`` untimed rounds of each way (None: the server's keep + 1), then ``repeats``."""
    setup.check(SAVERS, READERS)
    socket = ps_comm.socket_gbps(min(setup.nbytes, SOCKET_BYTES))
    with worlds(setup) as w:
        rounds = max(1, w.keep + 1 if warmup is None else warmup)
        tw_cold = tensorwire_round(w)  # a job's first checkpoint: every buffer is new
        for _ in range(rounds - 1):
            tensorwire_round(w)
        dcp_cold = dcp_round(w)  # every save writes new files: there is no warmer state to reach
        dcp_tw_cold = dcp_tw_round(w, 0)
        tw = _median_phases([tensorwire_round(w) for _ in range(repeats)])
        dcp = _median_phases([dcp_round(w) for _ in range(repeats)])
        dcp_tw = _median_phases([dcp_tw_round(w, n + 1) for n in range(repeats)])
        saves = w.ask(w.savers, "async_save", "reshard/async")
    result = summary(setup, repeats, socket, (tw, dcp, saves))
    result.update(warmup_rounds=rounds, tw_cold_s=_total(tw_cold), dcp_cold_s=_total(dcp_cold),
                  tw_cold_phases=tw_cold, dcp_tw_cold_s=_total(dcp_tw_cold))  # fmt: skip
    result.update(dcp_tw_figures(dcp_tw, dcp))
    return result


def dcp_tw_figures(dcp_tw_phases: dict[str, float], dcp_phases: dict[str, float]) -> dict[str, float]:
    """DCP through tensorwire.dcp against DCP's own files on tmpfs, the same 4 -> 2 reshard."""
    save, load = dcp_tw_phases["save4_s"], dcp_tw_phases["load2_s"]
    tmpfs = dcp_phases["save4_s"] + dcp_phases["load2_s"]
    return {"dcp_tw_save_s": save, "dcp_tw_load_s": load, "dcp_tmpfs_s": tmpfs,
            "dcp_tw_vs_tmpfs": (save + load) / tmpfs}  # fmt: skip


def _total(phases: dict[str, float]) -> float:
    return sum(v for k, v in phases.items() if k.endswith("_s"))


def summary(setup: Setup, repeats: int, socket: float, rounds: Rounds) -> dict[str, Any]:
    tw, dcp, saves = rounds
    tw_s = _total(tw)
    dcp_s = sum(dcp.values())
    moved = int(sum(v for k, v in tw.items() if k.endswith("_bytes")))
    overlap = overlap_bytes(setup)
    blocked, sync = _slowest(saves, "blocked_s"), _slowest(saves, "sync_s")
    return {
        "size_bytes": setup.nbytes, "tensors": setup.tensors, "shape": list(setup.shape),
        "transport": setup.transport,
        "worlds": [[SAVERS.size, f"Shard({SAVERS.dim})"], [READERS.size, f"Shard({READERS.dim})"]],
        "repeats": repeats,
        "tw_s": tw_s, "dcp_s": dcp_s, "tw_vs_dcp": tw_s / dcp_s,
        "bytes_moved": moved, "overlap_bytes": overlap,
        "moved_vs_overlap": moved / overlap,
        "fresh_bytes": int(sum(v for k, v in tw.items() if k.endswith("_fresh"))),
        "socket_gbps": socket, "tw_bound_s": moved / (socket * 1e9),
        "async_blocking_ratio": blocked / sync,
        "async_blocked_s": blocked, "async_first_blocked_s": _slowest(saves, "first_blocked_s"),
        "async_commit_s": _slowest(saves, "commit_s"), "sync_put_s": sync,
        "steps_during_upload": min(int(s["steps_during_upload"]) for s in saves),
        "tw_phases": tw, "dcp_phases": dcp,
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    d = Setup()
    parser = argparse.ArgumentParser(prog="tensorwire bench reshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument("--size", type=parse_size, default=d.size, help="the state dict's bytes (512MiB)")
    parser.add_argument("--tensors", type=int, default=d.tensors, help="how many tensors it is")
    parser.add_argument("--rows", type=int, default=d.rows, help="rows of each tensor (divisible by 4)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of each way (medians per phase)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed rounds first (default: the server's keep-generations + 1)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=d.timeout, help="seconds for each phase")
    parser.add_argument(
        "--transport", choices=TRANSPORTS, default=d.transport, help="the ranks' way to the server"
    )
    args = parser.parse_args(argv)
    setup = Setup(args.size, args.tensors, args.rows, args.timeout, args.transport)
    return show(run(setup, args.repeats, args.warmup), args.json, _readable)


def _readable(r: dict[str, Any]) -> str:
    rows, cols = r["shape"]
    head = (f"sharded state {r['size_bytes'] / MiB:,.0f} MiB ({r['tensors']} x {rows} x {cols} float32), "
            f"4 ranks Shard(0) -> 2 ranks Shard(1) -> 4 ranks, one tensorwire server ({r['transport']}://) "
            "vs torch.distributed.checkpoint on /dev/shm")  # fmt: skip
    lines = [
        ("tensorwire", f"{r['tw_s']:.3f} s", _phases(r["tw_phases"])),
        ("torch.distributed.checkpoint", f"{r['dcp_s']:.3f} s", _phases(r["dcp_phases"])),
        ("first round (cold)", f"{r['tw_cold_s']:.3f} s", f"dcp {r['dcp_cold_s']:.3f} s; then "
         f"{r['warmup_rounds']} untimed rounds; fresh bytes per timed round {_mib(r['fresh_bytes'])}"),
        ("tw_vs_dcp", f"{r['tw_vs_dcp']:.3f}", "target <= 0.5"),
        ("bytes moved", _mib(r["bytes_moved"]), f"overlap {_mib(r['overlap_bytes'])}: "
         f"moved_vs_overlap {_num(r['moved_vs_overlap'], '.4f')} (target <= 1.01)"),
        ("socket bound", f"{r['tw_bound_s']:.3f} s", f"one socket stream {r['socket_gbps']:.2f} GB/s"),
        ("DCP via tensorwire.dcp", f"{r['dcp_tw_save_s'] + r['dcp_tw_load_s']:.3f} s",
         f"save4 {r['dcp_tw_save_s']:.3f}, load2 {r['dcp_tw_load_s']:.3f}; "
         f"DCP on tmpfs {r['dcp_tmpfs_s']:.3f} s: "
         f"dcp_tw_vs_tmpfs {r['dcp_tw_vs_tmpfs']:.3f} (target <= 0.7)"),
        ("async save blocks", f"{r['async_blocked_s']:.3f} s", f"sync put {r['sync_put_s']:.3f} s: "
         f"async_blocking_ratio {r['async_blocking_ratio']:.3f} (target <= 0.1)"),
    ]  # fmt: skip
    return table(head, lines, 10)


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


def _num(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _phases(p: dict[str, float]) -> str:
    return ", ".join(f"{k[:-2]} {v:.3f}" for k, v in p.items() if k.endswith("_s"))


if __name__ == "__main__":
    main()
