"""A parameter server killed while it writes a checkpoint starts again, from the newest complete
one; a torn newest checkpoint is skipped (and said to be), and nothing in the checkpoint directory
is followed if it is a symbolic link. The servers keep their job when its worker leaves
(``--keep-jobs``): a server started again resumes it from its directory, ``<dir>/<job id>``."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import torch

from tensorwire.ps import SGD, CheckpointPolicy, ParamServer, Worker
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread
from tensorwire.testing.process import ServerProcess, wait_for


def job_directory(directory: Path) -> Path:
    """The one job's checkpoint directory under the server's ``--checkpoint-dir``."""
    (only,) = [p for p in directory.iterdir() if not p.name.startswith(("_", "."))]
    return only


def checkpoints(directory: Path) -> list[str]:
    return sorted(p.name for p in job_directory(directory).iterdir() if p.name.startswith("ckpt-"))


def serve(directory: Path) -> ServerProcess:
    return ServerProcess(extra=["--checkpoint-dir", str(directory), "--checkpoint-every", "1", "--keep-jobs"])


def train(url: str, net: torch.nn.Module, steps: int) -> None:
    with Worker(net, [url], "async", SGD(lr=0.1, momentum=0.9), rank=0, world_size=1, heartbeat=0) as w:
        for _ in range(steps):
            net(torch.ones(2, net.in_features)).pow(2).mean().backward()  # type: ignore[no-untyped-call,operator]
            w.step()


def test_a_torn_newest_checkpoint_is_skipped_and_the_server_starts_from_the_one_before(
    tmp_path: Path,
) -> None:
    """The newest checkpoint as a SIGKILL in an older release's shutdown save left it: its files
    half deleted. The server starts from the newest complete one, says so, and carries on."""
    directory = tmp_path / "ckpt"
    server = serve(directory)
    try:
        train(server.url, torch.nn.Linear(8, 4), 5)
    finally:
        server.proc.send_signal(signal.SIGKILL)  # no shutdown checkpoint: versions 3, 4, 5 stay
        server.stop()
    assert checkpoints(directory) == [f"ckpt-{v:012d}" for v in (3, 4, 5)]
    (job_directory(directory) / f"ckpt-{5:012d}" / "params.safetensors").unlink()

    server = serve(directory)  # before the fix: start-up failed on the torn checkpoint
    try:
        (stats,) = server_stats([server.url])
        assert stats["version"] == 4
        assert stats["checkpoint"] == {"restored": f"ckpt-{4:012d}", "skipped": 1}
        assert "not complete" in server.output()
        train(server.url, torch.nn.Linear(8, 4), 1)  # version 5 again, beside the torn one...
        assert f"ckpt-{5:012d}.1" in checkpoints(directory)
        assert f"ckpt-{5:012d}" not in checkpoints(directory)  # ...which is removed once it is published
    finally:
        server.stop()


def test_a_server_killed_during_its_shutdown_checkpoint_starts_again(tmp_path: Path) -> None:
    """SIGTERM starts the shutdown checkpoint; SIGKILL as soon as its temporary directory appears,
    while the files are written (32 MiB, fsynced). The restart finds every published checkpoint."""
    directory = tmp_path / "ckpt"
    server = serve(directory)
    try:
        train(server.url, torch.nn.Linear(2048, 2048), 1)  # 16 MiB of parameters, as much momentum
        version = server_stats([server.url])[0]["version"]
    finally:
        server.stop()  # its shutdown checkpoint: a second copy of the same version
    hits = 0
    for _ in range(4):  # the kill lands in the write window nearly always; retry the rare miss
        server = serve(directory)
        try:
            assert server_stats([server.url])[0]["version"] == version
            server.proc.send_signal(signal.SIGTERM)
            started = lambda: any(n.startswith(".tmp-") for n in os.listdir(job_directory(directory)))  # noqa: E731
            wait_for(started, 30, "the shutdown checkpoint to start", interval=0.0005)
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(30)
        finally:
            server.stop()
        if any(n.startswith(".tmp-") for n in os.listdir(job_directory(directory))):
            hits += 1  # killed in the middle of the write: its files are torn
            break
    assert hits == 1
    server = serve(directory)  # starts, from a whole checkpoint of the same version
    try:
        (stats,) = server_stats([server.url])
        assert stats["version"] == version and stats["checkpoint"]["skipped"] == 0
    finally:
        server.stop()
    assert not [n for n in os.listdir(job_directory(directory)) if n.startswith(".tmp-")]  # the stray is gone


def test_symbolic_links_in_the_checkpoint_directory_are_not_followed(tmp_path: Path) -> None:
    directory, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    policy = CheckpointPolicy(directory, 1)
    with ServerThread(extensions=[ParamServer(checkpoints=policy, keep_jobs=True)]) as server:
        train(server.url, torch.nn.Linear(8, 4), 2)
    newest = job_directory(directory) / checkpoints(directory)[-1]
    # A "newer checkpoint" that is a link to a directory somewhere else, with another job's state.
    shutil.copytree(newest, elsewhere)
    state = json.loads((elsewhere / "state.json").read_text())
    (elsewhere / "state.json").write_text(json.dumps({**state, "step": 12345}))
    (job_directory(directory) / f"ckpt-{999:012d}").symlink_to(elsewhere, target_is_directory=True)
    restored = ParamServer()
    assert restored.restore(directory)
    assert restored.step != 12345 and restored.restored_from == newest.name
    # A checkpoint whose file is a link is not complete: the one before it is taken.
    (newest / "params.safetensors").unlink()
    (newest / "params.safetensors").symlink_to(elsewhere / "params.safetensors")
    again = ParamServer()
    assert again.restore(directory)
    assert again.restored_from != newest.name and again.checkpoints_skipped == 1
