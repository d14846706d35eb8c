"""A rank SIGKILLed in the middle of ``sharded.put_state_dict`` (a real gloo job of 3 processes,
tests/integration/sharded_kit.py): the previous generation stays readable and whole, nothing of
the new one is visible, the surviving ranks get an error that says which part is missing (or
whose connection closed), and the server's held bytes return to what they were."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tensorwire
from tensorwire import sharded
from tensorwire.server import ServerThread
from tensorwire.testing.process import wait_for

KIT = Path(__file__).parents[1] / "integration" / "sharded_kit.py"
WORLD = 3
VICTIM = 1


@pytest.fixture
def server() -> Iterator[ServerThread]:
    with ServerThread() as srv:
        yield srv


def _start(world: int, scenario: dict[str, object], out: Path) -> list[subprocess.Popen[bytes]]:
    (out / "scenario.json").write_text(json.dumps(scenario))
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    args = [str(out / "init"), str(out / "scenario.json"), str(out)]
    return [
        subprocess.Popen([sys.executable, str(KIT), str(r), str(world), *args], env=env) for r in range(world)
    ]


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("before", r"WaitTimeout: .*timed out after 3s: 2 of 3 parts arrived \(missing: parts \[1\]\)"),
        (
            "mid",
            r"PublishAborted: .*the connection that sent its part 1 closed before the commit \(2 of 3",
        ),
    ],
    ids=["before-its-part-left", "halfway-through-its-part"],
)
def test_a_rank_killed_mid_put_leaves_the_previous_generation_and_frees_every_byte(
    server: ServerThread, tmp_path: Path, mode: str, says: str
) -> None:
    scenario = {"kind": "kill", "url": server.url, "prefix": "model", "victim": VICTIM, "out": str(tmp_path),
                "timeout": 3.0, "mode": mode}  # fmt: skip
    procs = _start(WORLD, scenario, tmp_path)
    store, parts = server.server.store, server.server.generation_ops.parts
    try:
        wait_for((tmp_path / "gen1").exists, 60, "generation 1 from every rank")
        held = store.used  # generation 1 kept, nothing in flight
        (tmp_path / "go").write_text("go")
        wait_for((tmp_path / "ready").exists, 30, "the victim to stall")
        wait_for(lambda: sum(len(t.parts) for t in parts.open.values()) == WORLD - 1, 30, "the others' parts")
        assert store.used > held  # the survivors' parts are held, waiting for the victim's
        procs[VICTIM].send_signal(signal.SIGKILL)
        for rank, proc in enumerate(procs):
            assert proc.wait(30) in (0, -signal.SIGKILL), f"rank {rank}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    survivors = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD) if r != VICTIM]
    for report in survivors:
        assert not report["failures"], report["failures"]
        assert re.search(says, report["error"]), report["error"]
    wait_for(lambda: not parts.open and store.used == held, 10, "the aborted parts' bytes to be freed")
    with tensorwire.connect(server.url) as client:
        assert client.manifest("model").generation.number == 1  # nothing of generation 2
        into = {name: torch.zeros_like(t) for name, t in _generation_one().items()}
        assert sharded.load_state_dict(client, "model", into).number == 1
    assert all(torch.equal(into[k], v) for k, v in _generation_one().items())


def _generation_one() -> dict[str, torch.Tensor]:
    """What the job put as generation 1, whole (the kit's seed 1), read here on one rank."""
    sys.path.insert(0, str(KIT.parent))
    try:
        import sharded_kit
    finally:
        sys.path.remove(str(KIT.parent))
    out = {}
    for i, (name, shape, dtype) in enumerate(sharded_kit.PARAMS):
        out[name] = sharded_kit.global_tensor(100 + i, shape, dtype)
    for i, (name, shape, dtype) in enumerate(sharded_kit.PLAIN):
        out[name] = sharded_kit.global_tensor(150 + i, shape, dtype)
    return out
