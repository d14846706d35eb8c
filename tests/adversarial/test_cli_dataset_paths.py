"""``dataset fetch`` against a hostile server: a real server holding forged manifests whose item
paths would reach outside ``--out`` ("", ".", "sub/..", "../x", absolute) or through symlinks
planted under it. Nothing is written outside ``--out``; links are replaced, never followed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from tensorwire import cli, connect
from tensorwire.dataset.fetch import fetch
from tensorwire.dataset.plan import FORMAT
from tensorwire.errors import InvalidName, InvalidTensor
from tensorwire.server import ServerThread
from tensorwire.wire.checksum import ChecksumKind, checksum


@pytest.fixture
def server() -> Iterator[ServerThread]:
    with ServerThread(["tcp://127.0.0.1:0"]) as srv:
        yield srv


def _forge(url: str, dataset: str, paths: list[Any], data: bytes = b"pwned\n") -> None:
    """A one-shard data set whose items (all holding ``data``) claim the given paths."""
    prefix = f"{dataset}/shard-00000/"
    items = []
    with connect(url) as c:
        for i, path in enumerate(paths):
            name = f"{prefix}files/item{i}"
            c.put(name, torch.frombuffer(bytearray(data), dtype=torch.uint8))
            items.append({"name": name, "dtype": "uint8", "shape": [len(data)], "nbytes": len(data),
                          "xxh3": f"{checksum(ChecksumKind.XXH3_64, data):016x}", "path": path})  # fmt: skip
        body = {"format": FORMAT, "dataset": dataset, "shard": 0, "shards": 1, "by": "files",
                "keys": [], "items": items}  # fmt: skip
        raw = json.dumps(body).encode()
        c.put(prefix + "manifest", torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize(
    "path", ["", ".", "sub/..", "..", "../escape", "sub/../../escape", "/tmp/abs", "a//b"]
)
def test_paths_that_leave_out_are_refused_and_nothing_is_written(
    server: ServerThread, tmp_path: Path, path: str
) -> None:
    _forge(server.url, "evil", [path])
    out = tmp_path / "out"
    before = _tree(tmp_path)
    with pytest.raises(InvalidName):
        fetch(server.url, out, "evil")
    assert _tree(tmp_path) - before <= {"out"}, "something was written outside --out"
    assert not any(out.iterdir()), "nothing of a refused manifest is written"


def test_a_symlinked_directory_under_out_is_never_followed(server: ServerThread, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(elsewhere, out / "sub")
    _forge(server.url, "evil", ["sub/x"])
    with pytest.raises(InvalidName, match="refusing to follow"):
        fetch(server.url, out, "evil")
    assert not any(elsewhere.iterdir())


def test_a_symlink_at_a_file_path_is_replaced_not_written_through(
    server: ServerThread, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    out = tmp_path / "out"
    (out / "d").mkdir(parents=True)
    os.symlink(victim, out / "d" / "x")
    os.mkfifo(out / "fifo")  # a FIFO planted at an item's path is not read (it would block)
    _forge(server.url, "ok", ["d/x", "fifo"])
    report = fetch(server.url, out, "ok")
    assert sorted(report.written) == ["d/x", "fifo"]
    assert victim.read_bytes() == b"keep me"
    assert not (out / "d" / "x").is_symlink() and (out / "d" / "x").read_bytes() == b"pwned\n"
    assert (out / "fifo").read_bytes() == b"pwned\n"


ITEM = {
    "name": "bad/shard-00000/files/x",
    "dtype": "uint8",
    "shape": [2],
    "nbytes": 2,
    "xxh3": "0",
    "path": "x",
}


@pytest.mark.parametrize(
    "items",
    [
        [{"name": "bad/shard-00000/files/x"}],
        [
            {
                "name": "bad/shard-00000/files/x",
                "dtype": "uint8",
                "shape": [2],
                "nbytes": 2,
                "xxh3": "0",
                "path": 7,
            }
        ],
        [{"name": "other/secret", "dtype": "uint8", "shape": [2], "nbytes": 2, "xxh3": "0", "path": "x"}],
        [
            {
                "name": "bad/shard-00000/files/x",
                "dtype": "bfloat16",
                "shape": [1],
                "nbytes": 2,
                "xxh3": "0",
                "path": "x",
            }
        ],
        "not a list",
    ],
)
def test_malformed_manifests_are_refused_as_invalid(server: ServerThread, tmp_path: Path, items: Any) -> None:
    body = {
        "format": FORMAT,
        "dataset": "bad",
        "shard": 0,
        "shards": 1,
        "by": "files",
        "keys": [],
        "items": items,
    }
    raw = json.dumps(body).encode()
    with connect(server.url) as c:
        c.put("bad/shard-00000/manifest", torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    with pytest.raises(InvalidTensor):
        fetch(server.url, tmp_path / "out", "bad")


def test_the_cli_prints_one_error_line(server: ServerThread, tmp_path: Path) -> None:
    _forge(server.url, "evil", ["sub/../.."])
    result = CliRunner().invoke(cli.main, ["dataset", "fetch", server.url, "--out", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
