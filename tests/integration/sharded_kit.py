"""One rank of a gloo job for the tensorwire.sharded tests (tests/integration/test_sharded.py,
tests/fault/test_sharded_faults.py): ``python sharded_kit.py RANK WORLD INIT_FILE SCENARIO OUT``.

The job's processes start once and run a whole scenario (a JSON file): ``tables``, one per server,
each putting every layout of every world size 1..W (subgroups of the one job: ranks 0..w-1) under
its own prefix, then reading each stored state back into every layout of every world size, and
checking each local shard bit for bit against the global tensor; ``kill`` puts a good generation,
then a second whose rank ``victim`` stops (the test kills it) before its part leaves. Each rank
writes ``OUT/rank<R>.json``: what it checked, what failed, how long the phases took.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import tensorwire
from tensorwire import sharded
from tensorwire.errors import TensorwireError
from tensorwire.sharded.state import _agreed
from tensorwire.types import Address, TensorMeta
from tensorwire.wire import generations as wg
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind
from tensorwire.wire.frame import Flags, Header, Opcode, encode_frame_head

PARAMS: list[tuple[str, tuple[int, ...], torch.dtype]] = [
    ("layer.0.weight", (8, 6), torch.float32),
    ("layer.0.uneven", (7, 5), torch.bfloat16),
    ("layer.1.ids", (6, 4), torch.int64),
]
PLAIN: list[tuple[str, tuple[int, ...], torch.dtype]] = [
    ("bias", (5,), torch.float32),
    ("step", (), torch.float64),
]


def layouts(world: int, small: bool) -> dict[str, tuple[tuple[int, ...], list[str]]]:
    """The layouts of a job of ``world`` ranks: name -> (mesh shape, placements)."""
    out = {"S0": ((world,), ["S0"]), "S1": ((world,), ["S1"]), "R": ((world,), ["R"])}
    if world == 4:
        out["2D"] = ((2, 2), ["S0", "S1"])
        out["RS"] = ((2, 2), ["R", "S0"])
    if small:
        out.pop("R")
    return out


def placement(p: str) -> Shard | Replicate:
    return Replicate() if p == "R" else Shard(int(p[1:]))


def global_tensor(seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(1 << 40), 1 << 40, shape, generator=gen, dtype=dtype)


class Job:
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.groups = {w: dist.new_group(list(range(w))) for w in range(1, world + 1)}
        self.meshes: dict[tuple[int, tuple[int, ...]], DeviceMesh] = {}
        for w in range(1, world + 1):  # every rank makes every mesh, in one order (a collective)
            self.meshes[(w, (w,))] = DeviceMesh("cpu", list(range(w)))
        if world >= 4:
            self.meshes[(4, (2, 2))] = DeviceMesh("cpu", [[0, 1], [2, 3]])

    def state(
        self, w: int, layout: tuple[tuple[int, ...], list[str]], seed: int, *, zeros: bool
    ) -> dict[str, torch.Tensor]:
        mesh = self.meshes[(w, layout[0])]
        places = [placement(p) for p in layout[1]]
        out: dict[str, torch.Tensor] = {}
        for i, (name, shape, dtype) in enumerate(PARAMS):
            full = global_tensor(seed * 100 + i, shape, dtype)
            local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, places)
            index = tuple(slice(o, o + n) for o, n in zip(offsets, local_shape, strict=True))
            local = torch.zeros(local_shape, dtype=dtype) if zeros else full[index].clone()
            out[name] = DTensor.from_local(
                local, mesh, places, run_check=False, shape=full.shape, stride=full.stride()
            )
        for i, (name, shape, dtype) in enumerate(PLAIN):
            full = global_tensor(seed * 100 + 50 + i, shape, dtype)
            out[name] = torch.zeros(shape, dtype=dtype) if zeros else full
        return out

    def expected(self, seed: int, into: dict[str, torch.Tensor]) -> list[str]:
        """What differs between ``into`` (this rank's shards) and the global tensors of ``seed``."""
        bad = []
        for i, (name, shape, dtype) in enumerate(PARAMS):
            full = global_tensor(seed * 100 + i, shape, dtype)
            d = into[name]
            local_shape, offsets = compute_local_shape_and_global_offset(shape, d.device_mesh, d.placements)
            index = tuple(slice(o, o + n) for o, n in zip(offsets, local_shape, strict=True))
            if not same_bits(d.to_local(), full[index]):
                bad.append(name)
        for i, (name, shape, dtype) in enumerate(PLAIN):
            if not same_bits(into[name], global_tensor(seed * 100 + 50 + i, shape, dtype)):
                bad.append(name)
        return bad


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit: dtype, shape and bytes (NaNs and -0.0 included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(
        torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


def run_tables(job: Job, scenario: dict[str, Any], report: dict[str, Any]) -> None:
    """Each table of ``scenario["tables"]`` in turn (one per server: tcp://, tls://, ...)."""
    for table in scenario["tables"]:
        result: dict[str, Any] = {"puts": [], "reads": 0, "failures": [], "refusals": []}
        report["tables"][table["tag"]] = result
        try:
            run_table(job, table, result)
            if table.get("disagree"):
                run_disagreement(job, table, result)
        except Exception as exc:  # the next table still runs; the test names this one
            result["failures"].append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            raise


def connect(table: dict[str, Any]) -> tensorwire.Client:
    """A client of the table's server with its options (JSON: ``ca`` is the TLS CA's path)."""
    options = dict(table.get("options", {}))
    if "ca" in options:
        options["tls"] = tensorwire.TlsFiles(ca=Path(options.pop("ca")))
    return tensorwire.connect(table["url"], **options)


def run_disagreement(job: Job, table: dict[str, Any], result: dict[str, Any]) -> None:
    """Ranks 0 and 1 put states that disagree (rank 1: another global shape; then a Partial
    placement): both are refused, on every rank, and nothing is visible."""
    if job.rank >= 2:
        return
    mesh = job.meshes[(2, (2,))]
    with connect(table) as client:
        shape = (8, 6) if job.rank == 0 else (8, 7)
        local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
        local = torch.zeros(local_shape)
        wrong = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=shape, stride=(shape[1], 1)
        )
        partial = DTensor.from_local(local, mesh, [Partial() if job.rank == 1 else Shard(0)], run_check=False,
                                     shape=shape, stride=(shape[1], 1))  # fmt: skip
        for what, state in (("shape", {"w": wrong}), ("partial", {"w": partial})):
            try:
                sharded.put_state_dict(client, f"{table['tag']}/disagree", state, group=job.groups[2])
                result["failures"].append(f"a put whose ranks disagree on its {what} succeeded")
            except TensorwireError as exc:
                result["refusals"].append(f"{type(exc).__name__}: {exc}")
        try:
            client.manifest(f"{table['tag']}/disagree")
            result["failures"].append("a refused put left a generation")
        except TensorwireError:
            pass


def run_table(job: Job, table: dict[str, Any], result: dict[str, Any]) -> None:
    """Put every layout of every world size of ``table["worlds"]`` (ranks 0..w-1), then read each
    stored state into every layout of every world size, checking each shard bit for bit."""
    small = bool(table.get("small"))
    worlds = table.get("worlds", list(range(1, job.world + 1)))
    stored: list[tuple[str, int]] = []  # (prefix, seed)
    started = time.monotonic()
    with connect(table) as client:
        seed = 1
        for w in worlds:
            for name, layout in layouts(w, small).items():
                prefix = f"{table['tag']}/w{w}{name}"
                if job.rank < w:
                    state = job.state(w, layout, seed, zeros=False)
                    gen = sharded.put_state_dict(client, prefix, state, group=job.groups[w])
                    result["puts"].append([prefix, gen.number])
                stored.append((prefix, seed))
                seed += 1
        dist.barrier()
        result["put_s"] = time.monotonic() - started
        started = time.monotonic()
        for r in worlds:
            for name, layout in layouts(r, small).items():
                if job.rank >= r:
                    continue
                for prefix, seed in stored:
                    into = job.state(r, layout, 0, zeros=True)
                    sharded.load_state_dict(client, prefix, into, group=job.groups[r])
                    result["reads"] += 1
                    bad = job.expected(seed, into)
                    if bad:
                        result["failures"].append(f"{prefix} read as r{r}{name}: {bad} differ")
        result["get_s"] = time.monotonic() - started
        dist.barrier()


def run_kill(job: Job, scenario: dict[str, Any], report: dict[str, Any]) -> None:
    """Generation 1 of ``prefix`` from every rank (then ``OUT/gen1``; on ``OUT/go`` the job goes
    on); then generation 2, where rank ``victim`` joins the layout exchange and stops: ``mode``
    "before" before its part leaves, "mid" halfway through its part's first frame. It writes
    ``OUT/ready`` and waits to be killed; the others' parts wait on the server meanwhile."""
    prefix, victim, out = scenario["prefix"], scenario["victim"], Path(scenario["out"])
    layout = ((job.world,), ["S0"])
    with tensorwire.connect(scenario["url"]) as client:
        gen = sharded.put_state_dict(client, prefix, job.state(job.world, layout, 1, zeros=False))
        report["puts"].append([prefix, gen.number])
        dist.barrier()
        if job.rank == 0:
            (out / "gen1").write_text(str(gen.number))
        _wait_for_file(out / "go")
        state = job.state(job.world, layout, 2, zeros=False)
        if job.rank == victim:
            layouts, txn = _agreed(state, None, job.rank, job.world, with_txn=True)  # as put_state_dict does
            sock = _start_part(scenario, layouts, txn, job) if scenario["mode"] == "mid" else None
            (out / "ready").write_text("stalled")
            time.sleep(600)  # SIGKILLed by the test long before
            del sock
        try:
            sharded.put_state_dict(client, prefix, state, timeout=scenario["timeout"])
            report["failures"].append("the second put succeeded without the victim's part")
        except TensorwireError as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"


def _start_part(scenario: dict[str, Any], layouts: dict[str, Any], txn: bytes, job: Job) -> socket.socket:
    """Half of the first chunk of the victim's part, sent raw (what a rank killed mid-send left)."""
    prefix = scenario["prefix"]
    mine = next(s for s in layouts["layer.0.weight"].boxes if s.rank == job.rank)
    meta = TensorMeta(f"{prefix}/{mine.tensor}", torch.float32, mine.box.sizes, mine.box.numel * 4)
    head = wg.encode_part_head(wg.PartHead(prefix, txn, job.rank, job.world, 30_000))
    block = head + wm.encode_records([meta])
    header = Header(
        1, Opcode.GEN_PUBLISH_PART, Flags.MORE, ChecksumKind.XXH3_64, 7, len(block), 4096, meta.nbytes
    )
    address = Address.parse(scenario["url"])
    sock = socket.create_connection((address.host, address.port), timeout=10)
    sock.sendall(encode_frame_head(header, block) + bytes(meta.nbytes // 2))
    return sock


def _wait_for_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout}s for {path}")
        time.sleep(0.02)


def main() -> None:
    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init, scenario_path, out = sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5])
    scenario = json.loads(scenario_path.read_text())
    report: dict[str, Any] = {"rank": rank, "puts": [], "tables": {}, "failures": []}
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        job = Job(rank, world)
        (run_kill if scenario["kind"] == "kill" else run_tables)(job, scenario, report)
    except BaseException as exc:  # reported to the test, which fails naming it
        report["failures"].append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        os._exit(0)  # no gloo teardown: a dead peer would make it hang


if __name__ == "__main__":
    main()
