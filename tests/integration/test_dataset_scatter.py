"""``tensorwire dataset scatter`` against three real ``tensorwire serve --data-dir`` processes: a run
killed with SIGKILL midway, a re-run that sends only what is missing, every byte checked after.

"Nothing sent twice" here means: no item that was visible on a node after the kill is put again
by the re-run (its version on the node is unchanged), and the re-run's sent items are exactly the
ones missing, up to one per node: an item whose last bytes were in flight at the kill may become
visible just after it, and then it is (rightly) skipped. An item cut off mid-transfer is never
visible (a put shows only once all of it is verified), so its bytes are sent again in full: that
is the one resend per node an interruption costs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from tensorwire import cli, connect
from tensorwire.dataset import ScatterReport, ShardDataset, scatter
from tensorwire.testing.process import ServerProcess, run_threads, wait_for

NODES = 3


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[ServerProcess, Path]]]:
    dirs = [tmp_path_factory.mktemp(f"node{i}") for i in range(NODES)]
    started: list[ServerProcess | None] = [None] * NODES

    def start(i: int) -> None:
        started[i] = ServerProcess(data_dir=dirs[i], start_timeout=60)

    try:
        run_threads(start, NODES, timeout=90)  # three cold starts (torch imports) side by side
        yield [(srv, d) for srv, d in zip(started, dirs, strict=True) if srv is not None]
    finally:
        for srv in started:
            if srv is not None:
                srv.stop()


def _source(root: Path) -> dict[str, bytes]:
    """A folder of 48 files in nested folders, 6-40 KiB each, random bytes (and one empty file)."""
    files: dict[str, bytes] = {}
    rng = random.Random(8)
    for i in range(48):
        rel = f"class-{i % 4}/img {i:03d}.bin" if i % 3 else f"top-{i:03d}.dat"
        files[rel] = rng.randbytes(rng.randrange(6 << 10, 40 << 10))
    files["class-0/empty.txt"] = b""
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _scatter(src: Path, urls: list[str], *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "tensorwire.cli", "dataset", "scatter", str(src), "--to", ",".join(urls)]
    return subprocess.Popen([*cmd, "--json", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _held(urls: list[str], prefix: str) -> dict[str, dict[str, int]]:
    """Per node, the items of data set ``prefix`` it holds now and their versions."""
    held: dict[str, dict[str, int]] = {}
    for url in urls:
        with connect(url, timeout=10) as client:
            held[url] = {m.name: m.version for m in client.list(prefix) if "/files/" in m.name}
    return held


def test_scatter_killed_midway_resumes_without_resending(
    nodes: list[tuple[ServerProcess, Path]], tmp_path: Path
) -> None:
    files = _source(tmp_path / "photos")
    urls = [srv.url for srv, _ in nodes]
    total = len(files)

    # Run 1, paced (64 KiB/s per node: ~6 s for the lot), killed once 9 items have landed.
    first = _scatter(tmp_path / "photos", urls, "--max-rate", "64KiB")
    try:
        wait_for(
            lambda: sum(map(len, _held(urls, "photos/").values())) >= 9 or first.poll() is not None,
            60,
            "9 items of the first scatter to land",
            interval=0.05,
        )
        assert first.poll() is None, f"the paced scatter ended early: {first.communicate()}"
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(10)
    assert first.returncode == -signal.SIGKILL
    landed = _held(urls, "photos/")
    n_landed = sum(map(len, landed.values()))
    assert 9 <= n_landed < total
    with connect(urls[0], timeout=10) as client:  # no shard is complete: no manifest was written
        assert not [m for m in client.list("photos/") if m.name.endswith("/manifest")]

    # Run 2: sends the rest, verifies everything on the nodes, writes the manifests.
    second = _scatter(tmp_path / "photos", urls)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err.decode()
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["ok"] and report["items"] == total
    after = _held(urls, "photos/")
    sent = sum(node["sent_items"] for node in report["nodes"])
    for node in report["nodes"]:
        assert node["verified"] and node["error"] is None
        assert node["sent_items"] + node["skipped_items"] == node["items"]
        assert node["sent_bytes"] + node["skipped_bytes"] == node["bytes"]
        for name, version in landed[node["url"]].items():  # what landed in run 1 was not put again
            assert after[node["url"]][name] == version, f"{name} was sent twice"
        assert node["skipped_items"] >= len(landed[node["url"]])
    assert total - n_landed - NODES <= sent <= total - n_landed
    assert sum(map(len, after.values())) == total  # each file on exactly one node

    # A third run (in this process) finds everything in place and sends nothing.
    again = scatter(tmp_path / "photos", urls)
    assert again.ok and all(node.sent_items == 0 and node.pruned == 0 for node in again.nodes)

    # Every byte: fetch each node's shard back (from its server) and compare with the source.
    fetched: dict[str, bytes] = {}
    for i, url in enumerate(urls):
        target = tmp_path / f"fetched{i}"
        result = CliRunner().invoke(cli.main, ["dataset", "fetch", url, "--out", str(target)])
        assert result.exit_code == 0, result.output
        for path in target.rglob("*"):
            if path.is_file():
                rel = path.relative_to(target).as_posix()
                assert rel not in fetched, f"{rel} is on two nodes"
                fetched[rel] = path.read_bytes()
    assert fetched == files

    # The Dataset over a node's data directory (as a training process on that node reads it).
    srv, data_dir = nodes[1]
    ds = ShardDataset(data_dir)
    assert ds.by == "files" and len(ds) == len(after[srv.url])
    for path, tensor in ds:
        assert tensor.numpy().tobytes() == files[path]


def _sent_pruned(report: ScatterReport) -> tuple[int, int]:
    assert report.ok, [node.error for node in report.nodes]
    return sum(n.sent_items for n in report.nodes), sum(n.pruned for n in report.nodes)


def test_one_file_added_edited_or_removed_moves_only_that_file(
    nodes: list[tuple[ServerProcess, Path]], tmp_path: Path
) -> None:
    """The assignment is stable: a re-run after one change sends (or prunes) that file alone.
    Packing by size (before rendezvous hashing) sent 10 and pruned 9 after the same addition.
    An edited tree is another tree: each re-run says ``replace=True``."""
    urls = [srv.url for srv, _ in nodes]
    src = tmp_path / "stable"
    rng = random.Random(21)
    files = {f"part-{i % 3}/{i:02d}.bin": rng.randbytes(rng.randrange(10_000, 100_000)) for i in range(21)}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    assert _sent_pruned(scatter(src, urls)) == (21, 0)

    files["part-1/added.bin"] = rng.randbytes(50_000)
    (src / "part-1/added.bin").write_bytes(files["part-1/added.bin"])
    assert _sent_pruned(scatter(src, urls, replace=True)) == (1, 0)

    files["part-0/00.bin"] += rng.randbytes(40_000)  # a size change reshuffled a packing by size
    (src / "part-0/00.bin").write_bytes(files["part-0/00.bin"])
    assert _sent_pruned(scatter(src, urls, replace=True)) == (1, 0)

    del files["part-2/05.bin"]
    (src / "part-2/05.bin").unlink()
    assert _sent_pruned(scatter(src, urls, replace=True)) == (0, 1)

    held = _held(urls, "stable/")
    assert sorted(name.split("/files/", 1)[1] for names in held.values() for name in names) == sorted(files)
