"""Operator mistakes with ``dataset scatter`` and ``fetch`` against real servers: a second scatter
of another tree (or of the same tree with other options, or edited) under a name in use, a name
inside another data set's shards, a replace cut short, a fetch into an --out holding other files.
Each is refused before anything changes (``DatasetConflict``, naming ``--replace``) or, with
``--replace``, done and said; a re-run of the same tree still resumes with no flag."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tensorwire import ServerThread, TensorStore, cli, connect
from tensorwire.dataset import DigestService, ShardDataset, fetch, make_plan, scatter
from tensorwire.dataset.identity import identity_name
from tensorwire.dataset.plan import FORMAT, plan_identity
from tensorwire.errors import DatasetConflict, InvalidName
from tensorwire.wire.checksum import ChecksumKind, checksum


def _server() -> ServerThread:
    store = TensorStore(1 << 30)
    return ServerThread(store=store, extensions=[DigestService(store)])


@pytest.fixture
def nodes() -> Iterator[list[ServerThread]]:
    started: list[ServerThread] = []
    try:
        for _ in range(2):
            started.append(_server())
        yield started
    finally:
        for srv in started:
            srv.close()


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def _held(urls: list[str], prefix: str) -> dict[str, int]:
    """Every name under ``prefix`` on every node, with its version."""
    held: dict[str, int] = {}
    for url in urls:
        with connect(url) as client:
            held |= {f"{url} {m.name}": m.version for m in client.list(prefix)}
    return held


FIRST = {f"class-{i % 3}/img-{i:02d}.bin": bytes([i]) * (200 + i) for i in range(12)}
SECOND = {f"other-{i:02d}.txt": bytes([100 + i]) * (300 + i) for i in range(9)}


def test_a_second_scatter_of_another_tree_under_the_same_name_prunes_nothing(
    nodes: list[ServerThread], tmp_path: Path
) -> None:
    """Two folders both called ``images``: the default name is the same. Before identities the
    second scatter sent its files and pruned every one of the first's."""
    urls = [srv.url for srv in nodes]
    first = _tree(tmp_path / "a" / "images", FIRST)
    second = _tree(tmp_path / "b" / "images", SECOND)
    assert scatter(first, urls).ok
    before = _held(urls, "images/")

    with pytest.raises(DatasetConflict, match="--replace") as refused:
        scatter(second, urls)
    assert str(first.resolve()) in str(refused.value)  # says what is there, and where it came from
    assert _held(urls, "images/") == before  # nothing sent, nothing pruned, not even the claim

    result = CliRunner().invoke(cli.main, ["dataset", "scatter", str(second), "--to", ",".join(urls)])
    assert result.exit_code == 1 and "--replace" in result.output
    assert result.output.splitlines()[-1].startswith("error: ")
    assert _held(urls, "images/") == before

    result = CliRunner().invoke(
        cli.main, ["dataset", "scatter", str(second), "--to", ",".join(urls), "--replace"]
    )
    assert result.exit_code == 0, result.output
    assert "replaced" in result.output  # said loudly, per node
    fetched: dict[str, bytes] = {}
    for i, url in enumerate(urls):
        report = fetch(url, tmp_path / f"out{i}", "images")
        fetched |= {rel: (tmp_path / f"out{i}" / rel).read_bytes() for rel in report.written}
    assert fetched == SECOND  # the first tree's files are gone from the nodes, only now


def test_a_rerun_of_the_same_tree_resumes_with_no_flag(nodes: list[ServerThread], tmp_path: Path) -> None:
    urls = [srv.url for srv in nodes]
    src = _tree(tmp_path / "photos", FIRST)
    calls = 0

    def cut(node: int, nbytes: int) -> None:  # the first run dies after a few items
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RuntimeError("cut off")

    first = scatter(src, urls, advance=cut)
    assert not first.ok
    again = scatter(src, urls)  # the same tree: no DatasetConflict, only what is missing is sent
    assert again.ok and 0 < sum(n.sent_items for n in again.nodes) < len(FIRST)
    assert sum(n.sent_items + n.skipped_items for n in again.nodes) == len(FIRST)
    assert not any(n.replaced for n in again.nodes)
    assert scatter(src, urls).ok  # and once more: nothing to do


def test_other_options_or_an_edited_tree_are_another_plan(nodes: list[ServerThread], tmp_path: Path) -> None:
    urls = [srv.url for srv in nodes]
    src = _tree(tmp_path / "set", FIRST)
    assert scatter(src, urls, shards=2).ok
    before = _held(urls, "set/")
    with pytest.raises(DatasetConflict, match="2 shards by files"):
        scatter(src, urls, shards=3)  # would move a third of the files and prune them where they were
    edited = src / "class-0/img-00.bin"
    edited.write_bytes(b"edited, same size".ljust(200, b"."))
    os.utime(edited, ns=(1, 1))
    with pytest.raises(DatasetConflict):
        scatter(src, urls, shards=2)  # would overwrite the file's copy on its node
    assert _held(urls, "set/") == before
    report = scatter(src, urls, shards=2, replace=True)
    assert report.ok and sum(n.sent_items for n in report.nodes) == 1
    assert [n.replaced is not None for n in report.nodes] == [True, True]


def test_a_node_holding_shards_with_no_identity_needs_replace(
    nodes: list[ServerThread], tmp_path: Path
) -> None:
    """Shards written by hand (or by a tensorwire before identities) under the name."""
    url = nodes[0].url
    data = b"someone else's"
    with connect(url) as client:
        client.put("legacy/shard-00000/files/x", torch.frombuffer(bytearray(data), dtype=torch.uint8))
    with pytest.raises(DatasetConflict, match="no identity record"):
        scatter(_tree(tmp_path / "legacy", SECOND), [url])
    with connect(url) as client:
        assert [m.name for m in client.list("legacy/")] == ["legacy/shard-00000/files/x"]


def test_an_identity_record_that_cannot_be_read_is_not_read(
    nodes: list[ServerThread], tmp_path: Path
) -> None:
    """A record of 100 KiB (a server's, so not trusted) is refused unread, never overwritten silently."""
    url = nodes[0].url
    with connect(url) as client:
        client.put(identity_name("big"), torch.zeros(100 << 10, dtype=torch.uint8))
    with pytest.raises(DatasetConflict, match="cannot be read"):
        scatter(_tree(tmp_path / "big", SECOND), [url])
    with connect(url) as client:  # a record that is not JSON: the same
        client.put(identity_name("big"), torch.frombuffer(bytearray(b"\x1b[2J{"), dtype=torch.uint8))
    with pytest.raises(DatasetConflict, match="cannot be read"):
        scatter(_tree(tmp_path / "big", SECOND), [url])


def test_a_data_set_cannot_be_named_inside_another_ones_shards(tmp_path: Path) -> None:
    """``a/shard-00001`` lay inside the shards of ``a``: a one-shard scatter of ``a`` pruned it."""
    src = _tree(tmp_path / "x", SECOND)
    for name in ("a/shard-00001", "shard-7", "a/shard-1/b"):
        with pytest.raises(InvalidName, match="shard-N"):
            make_plan(src, 1, dataset=name)
    assert make_plan(src, 1, dataset="a/shards-1").dataset == "a/shards-1"


def test_shards_a_node_no_longer_owns_are_dropped_only_once_every_node_is_done(
    nodes: list[ServerThread], tmp_path: Path
) -> None:
    """Three shards, then two with --replace, where the second node cannot take its shard (it
    serves no DIGEST): before, the first node dropped shard 2 as soon as its own shard was done,
    though the files of shard 2 had not reached their new shard on the failed node."""
    good = nodes[0].url
    src = _tree(tmp_path / "set", FIRST)
    assert scatter(src, [good], shards=3).ok
    with ServerThread() as no_digest:
        report = scatter(src, [good, no_digest.url], shards=2, replace=True)
    assert report.nodes[0].verified and not report.nodes[1].verified
    assert "did not finish" in (report.nodes[0].tidy or "")
    with connect(good) as client:
        assert client.list("set/shard-00002/")  # kept: its files have no verified copy elsewhere
    report = scatter(src, [good], shards=2)  # the same plan (two shards), now all on one node
    assert report.ok and report.nodes[0].tidy is None
    with connect(good) as client:
        assert not client.list("set/shard-00002/")


def test_one_store_under_two_urls_keeps_both_shards(tmp_path: Path) -> None:
    """The tidy phase drops a shard a node does not own, unless another URL of its store owns it
    (HELLO says which store answers): one server, two listeners, both named in --to."""
    store = TensorStore(1 << 30)
    with ServerThread(["tcp://127.0.0.1:0", "tcp://127.0.0.1:0"], store=store,
                      extensions=[DigestService(store)]) as srv:  # fmt: skip
        urls = [str(address) for address in srv.addresses]
        src = _tree(tmp_path / "twice", FIRST)
        report = scatter(src, urls, shards=2)
        assert report.ok and sum(n.pruned for n in report.nodes) == 0
        with ShardDataset(urls[0]) as ds:
            assert [s.index for s in ds.shards.shards] == [0, 1]
            assert sorted(path for path, _ in ds) == sorted(FIRST)


def test_a_node_left_with_shards_of_two_trees_is_refused_when_read(
    nodes: list[ServerThread], tmp_path: Path
) -> None:
    url = nodes[0].url
    with connect(url) as client:
        for shard, identity in ((0, "aa" * 16), (1, "bb" * 16)):
            body = {"format": FORMAT, "dataset": "mixed", "shard": shard, "shards": 2, "by": "files",
                    "keys": [], "identity": identity, "items": []}  # fmt: skip
            raw = bytearray(json.dumps(body).encode())
            client.put(f"mixed/shard-{shard:05d}/manifest", torch.frombuffer(raw, dtype=torch.uint8))
    with pytest.raises(DatasetConflict, match="2 different scatters"):
        ShardDataset(url, "mixed")


# -- fetch into an --out that holds files ---------------------------------------------------------
def test_fetch_does_not_overwrite_other_files_under_out(nodes: list[ServerThread], tmp_path: Path) -> None:
    url = nodes[0].url
    assert scatter(_tree(tmp_path / "docs", SECOND), [url]).ok
    out = tmp_path / "out"
    out.mkdir()
    mine = out / "other-03.txt"
    mine.write_bytes(b"my own notes, not the data set's")
    with pytest.raises(DatasetConflict, match="--replace"):
        fetch(url, out)
    assert mine.read_bytes() == b"my own notes, not the data set's"
    assert sorted(p.name for p in out.iterdir()) == ["other-03.txt"]  # nothing written at all

    result = CliRunner().invoke(cli.main, ["dataset", "fetch", url, "--out", str(out)])
    assert result.exit_code == 1 and "--replace" in result.output and "other-03.txt" in result.output

    report = fetch(url, out, replace=True)
    assert report.replaced == ["other-03.txt"] and len(report.written) == len(SECOND)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == SECOND
    again = fetch(url, out)  # a re-run (a resume) finds everything there: no flag needed
    assert len(again.unchanged) == len(SECOND) and not again.written


def test_fetch_of_rows_does_not_overwrite_another_shard_file(
    nodes: list[ServerThread], tmp_path: Path
) -> None:
    url = nodes[0].url
    (tmp_path / "rows").mkdir()
    np.save(tmp_path / "rows" / "x.npy", np.arange(40, dtype=np.float32).reshape(10, 4))
    assert scatter(tmp_path / "rows", [url], shards=2, by="rows").ok
    out = tmp_path / "out"
    out.mkdir()
    theirs = out / "rows-shard-00001.safetensors"
    theirs.write_bytes(b"another data set's shard")
    with pytest.raises(DatasetConflict, match="rows-shard-00001"):
        fetch(url, out)
    assert sorted(p.name for p in out.iterdir()) == [theirs.name]
    assert theirs.read_bytes() == b"another data set's shard"
    report = fetch(url, out, replace=True)
    assert report.replaced == [theirs.name] and len(report.written) == 2
    data = theirs.read_bytes()
    assert checksum(ChecksumKind.XXH3_64, data) != checksum(ChecksumKind.XXH3_64, b"another data set's shard")


def _normalised(root: Path, files: dict[str, bytes]) -> Path:
    """``files`` under ``root`` with every modification time set to one value, as ``tar --mtime``,
    Nix or Bazel outputs and rebuilt image layers have them."""
    _tree(root, files)
    for rel in files:
        os.utime(root / rel, ns=(10**18, 10**18))
    return root


def test_two_trees_that_differ_only_in_contents_are_not_one_data_set(
    nodes: list[ServerThread], tmp_path: Path
) -> None:
    """Same names, same sizes, normalised times: one identity (contents are not hashed). Before,
    the second scatter was taken for a repair of the first and silently overwrote it; the source
    (host and path) in the identity record now tells them apart."""
    urls = [srv.url for srv in nodes]
    other = {rel: bytes([255 - data[0]]) * len(data) for rel, data in FIRST.items()}
    first = _normalised(tmp_path / "build-1" / "images", FIRST)
    second = _normalised(tmp_path / "build-2" / "images", other)
    assert plan_identity(make_plan(first, 2)) == plan_identity(make_plan(second, 2))  # one identity
    report = scatter(first, urls)
    assert report.ok
    before = _held(urls, "images/")
    with pytest.raises(DatasetConflict, match="from another source") as refused:
        scatter(second, urls)  # before: no error, every item of the first overwritten
    assert str(first.resolve()) in str(refused.value) and "--replace" in str(refused.value)
    assert _held(urls, "images/") == before
    assert scatter(first, urls).ok  # the first tree's own re-run: no flag needed
    replaced = scatter(second, urls, replace=True)
    assert replaced.ok and all(n.replaced for n in replaced.nodes)
    fetched: dict[str, bytes] = {}
    for i, url in enumerate(urls):
        got = fetch(url, tmp_path / f"out{i}", "images")
        fetched |= {rel: (tmp_path / f"out{i}" / rel).read_bytes() for rel in got.written}
    assert fetched == other
    assert scatter(second, urls).ok  # the record is the second's now: its re-run needs no flag
