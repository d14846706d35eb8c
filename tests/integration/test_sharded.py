"""tensorwire.sharded end to end: gloo jobs of 1-4 processes (DTensor on CPU) put sharded state to
a real server on loopback and read it back on every other world size and placement, bit for bit
(sharded_kit.py runs a whole layout table inside one job: torch and gloo start once per job).
Over tcp:// (the full table), tls://, shm://, grpc:// and grpcs:// (a smaller one: grpcs:// with
a token, over TLS); a transport without multi-part publishes is refused naming what it lacks; a
world of one without torch.distributed (also over grpc://); a read whose dtype or shape differs is refused
naming both layouts before any byte moves."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorwire
from tensorwire import sharded
from tensorwire.client.ranges import open_read
from tensorwire.errors import LayoutMismatch, UnsupportedTransport
from tensorwire.security import TlsFiles, write_dev_certs
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions
from tensorwire.store import TensorStore
from tensorwire.transport.base import as_part_publisher
from tensorwire.types import Address, MiB

KIT = Path(__file__).with_name("sharded_kit.py")
TOKEN = "sharded-over-tls"


def run_job(world: int, scenario: dict[str, Any], out: Path, timeout: float = 90.0) -> list[dict[str, Any]]:
    """Run ``world`` kit processes on ``scenario`` and return their reports, by rank; every
    process is ended, also when the job fails."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "scenario.json").write_text(json.dumps(scenario))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    args = [str(out / "init"), str(out / "scenario.json"), str(out)]
    procs = [
        subprocess.Popen([sys.executable, str(KIT), str(r), str(world), *args], env=env) for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def layouts_of(world: int, small: bool) -> int:
    return 3 + (2 if world == 4 else 0) - (1 if small else 0)


@pytest.fixture(scope="module")
def tcp() -> Iterator[ServerThread]:
    with ServerThread(store=TensorStore(512 * MiB)) as srv:
        yield srv


@pytest.fixture(scope="module")
def tables(tcp: ServerThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict[str, Any]]]:
    """One job of 4 processes runs every table: the full one over tcp://, smaller ones (worlds 1
    and 2) over tls://, shm://, grpc:// and grpcs://. The reports, by rank."""
    tmp = tmp_path_factory.mktemp("sharded")
    paths = write_dev_certs(tmp / "certs")
    served = ServerOptions(tls=TlsFiles(paths["server"], paths["server_key"]), token=TOKEN)
    with (
        ServerThread(["tls://127.0.0.1:0"], served) as tls,
        ServerThread(["shm://127.0.0.1:0"], store=TensorStore(256 * MiB)) as shm,
        ServerThread(
            ["grpc://127.0.0.1:0", "grpcs://127.0.0.1:0"],
            served,
        ) as grpc,
    ):
        tls_options = {"ca": str(paths["ca"]), "token": TOKEN}  # the kit makes it tls=TlsFiles(ca=...)
        small = {"small": True, "worlds": [1, 2]}
        scenario = {"kind": "tables", "tables": [
            {"tag": "tcp", "url": tcp.url, "disagree": True},
            {"tag": "tls", "url": tls.url.replace("127.0.0.1", "localhost"), "options": tls_options, **small},
            {"tag": "shm", "url": shm.url, **small},
            {"tag": "grpc", "url": str(grpc.addresses[0]), "options": {"token": TOKEN}, **small},
            {"tag": "grpcs", "url": str(grpc.addresses[1]).replace("127.0.0.1", "localhost"),
             "options": tls_options, **small},
        ]}  # fmt: skip
        yield run_job(4, scenario, tmp / "job")


def check(reports: list[dict[str, Any]], tag: str, worlds: list[int], small: bool) -> None:
    stored = sum(layouts_of(w, small) for w in worlds)
    for rank, report in enumerate(reports):
        assert not report["failures"], report["failures"]
        table = report["tables"][tag]
        assert not table["failures"], table["failures"]
        assert table["reads"] == sum(layouts_of(r, small) * stored for r in worlds if rank < r)


def test_every_layout_pair_of_worlds_1_to_4_round_trips_bit_exactly_over_tcp(
    tables: list[dict[str, Any]],
) -> None:
    check(tables, "tcp", [1, 2, 3, 4], small=False)
    # Every put of one state answered every rank of its world with the same generation.
    by_prefix: dict[str, set[int]] = {}
    for report in tables:
        for prefix, number in report["tables"]["tcp"]["puts"]:
            by_prefix.setdefault(prefix, set()).add(number)
    assert len(by_prefix) == 14 and all(len(numbers) == 1 for numbers in by_prefix.values())


def test_a_put_whose_ranks_disagree_is_refused_on_every_rank_and_leaves_nothing(
    tables: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        refusals = tables[rank]["tables"]["tcp"]["refusals"]
        assert len(refusals) == 2, refusals
        assert re.match(
            r"LayoutMismatch: 'w': rank 1 holds it as float32 \[8, 7\].*rank 0 as float32 \[8, 6\]",
            refusals[0],
        )
        assert re.match(r"LayoutMismatch: rank 1: 'w': placement P\(sum\) is not supported", refusals[1])


def test_a_smaller_table_over_tls(tables: list[dict[str, Any]]) -> None:
    check(tables, "tls", [1, 2], small=True)


def test_a_smaller_table_over_shm(tables: list[dict[str, Any]]) -> None:
    check(tables, "shm", [1, 2], small=True)


def test_a_smaller_table_over_grpc(tables: list[dict[str, Any]]) -> None:
    check(tables, "grpc", [1, 2], small=True)


def test_a_smaller_table_over_grpcs_with_a_token(tables: list[dict[str, Any]]) -> None:
    check(tables, "grpcs", [1, 2], small=True)


@pytest.fixture(scope="module")
def grpc_server() -> Iterator[ServerThread]:
    with ServerThread(["grpc://127.0.0.1:0"]) as srv:
        yield srv


@pytest.mark.parametrize("over", ["tcp", "grpc"])
def test_a_world_of_one_without_torch_distributed(
    over: str, tcp: ServerThread, grpc_server: ServerThread
) -> None:
    state = {"w": torch.randn(7, 5).to(torch.bfloat16), "b": torch.arange(4.0), "n": torch.tensor(3)}
    with tensorwire.connect((tcp if over == "tcp" else grpc_server).url) as client:
        gen = sharded.put_state_dict(client, "solo", state)
        assert set(gen.names) == {"solo/_layout", "solo/w/o0_0", "solo/b/o0", "solo/n/o"}
        into = {k: torch.zeros_like(v) for k, v in state.items()}
        assert sharded.load_state_dict(client, "solo", into, at=gen.number) == gen
    assert all(torch.equal(into[k], state[k]) for k in state)
    assert sharded.layout_of(state)["w"].describe() == "bfloat16 [7, 5] (plain)"


def test_a_read_whose_dtype_or_shape_differs_is_refused_before_any_byte_moves(tcp: ServerThread) -> None:
    state = {"a": torch.arange(12.0).reshape(3, 4), "z": torch.ones(6, dtype=torch.float16)}
    with tensorwire.connect(tcp.url) as client:
        sharded.put_state_dict(client, "mismatch", state)
        wrong_dtype = {"a": torch.zeros(3, 4), "z": torch.zeros(6)}
        with pytest.raises(LayoutMismatch, match=r"'z' is stored as float16 \[6\].*read into float32 \[6\]"):
            sharded.load_state_dict(client, "mismatch", wrong_dtype)
        assert not wrong_dtype["a"].any()  # 'a' would have read fine: nothing was read
        wrong_shape = {"a": torch.zeros(4, 3)}
        with pytest.raises(
            LayoutMismatch, match=r"'a' is stored as float32 \[3, 4\].*read into float32 \[4, 3\]"
        ):
            sharded.load_state_dict(client, "mismatch", wrong_shape)
        with pytest.raises(LayoutMismatch, match="'missing' is not in generation"):
            sharded.load_state_dict(client, "mismatch", {"missing": torch.zeros(1)})


def test_a_transport_without_the_capabilities_is_refused_naming_what_it_lacks() -> None:
    """What sharded needs is asked of the transport object (every transport has it today): one
    that lacks it is refused, naming it and its scheme."""

    class Bare:  # a transport with none of the generation capabilities
        address = Address.parse("grpc://127.0.0.1:1")

    bare: Any = Bare()
    with pytest.raises(UnsupportedTransport, match=r"GEN_PUBLISH_PART.*grpc://"):
        as_part_publisher(bare, "a multi-part publish")
    with pytest.raises(UnsupportedTransport, match=r"ranged reads of generations.*grpc://"):
        asyncio.run(open_read(None, bare, "g", 0))  # type: ignore[arg-type]
