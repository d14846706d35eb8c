"""Dataset scatter by rows, tampering caught end to end, and the DIGEST opcode, against in-process
servers on loopback ports (the kill-and-resume run with real processes is test_dataset_scatter.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner

from tensorwire import ServerThread, TensorStore, cli, connect
from tensorwire.dataset import DigestService, ShardDataset, fetch, make_plan, scatter
from tensorwire.dataset.digest import fetch_digests
from tensorwire.dataset.plan import assign_shard
from tensorwire.errors import ProtocolError, VerificationFailed
from tensorwire.transport import TransportOptions, open_transport
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.types import Address
from tensorwire.wire import meta as wm
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.frame import Opcode


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[ServerThread]]:
    threads: list[ServerThread] = []
    try:
        for i in range(2):
            store = TensorStore(1 << 30, tmp_path / f"node{i}")
            threads.append(ServerThread(store=store, extensions=[DigestService(store)]))
        yield threads
    finally:
        for srv in threads:
            srv.close()


def _rows_source(root: Path) -> dict[str, torch.Tensor]:
    root.mkdir()
    gen = torch.Generator().manual_seed(3)
    tensors = {
        "x": torch.randn(997, 12, generator=gen),
        "y": torch.randint(0, 10, (997,), generator=gen),
        "mask": torch.rand(997, 3, generator=gen) > 0.5,
    }
    safetensors.torch.save_file({"x": tensors["x"], "mask": tensors["mask"]}, str(root / "train.safetensors"))
    np.save(root / "y.npy", tensors["y"].numpy())
    return tensors


def test_rows_split_over_nodes_read_back_as_datasets(servers: list[ServerThread], tmp_path: Path) -> None:
    tensors = _rows_source(tmp_path / "digits")
    urls = [srv.url for srv in servers]
    report = scatter(tmp_path / "digits", urls, shards=3, by="rows", block_bytes=4096)
    assert report.ok, [n.error for n in report.nodes]
    assert [n.shards for n in report.nodes] == [[0, 2], [1]]
    assert sum(n.sent_items for n in report.nodes) == report.as_dict()["items"] > 9  # 4 KiB blocks

    # Node 0 holds shards 0 and 2, node 1 shard 1: rows [0, 332), [664, 997) and [332, 664).
    node0, node1 = ShardDataset(urls[0]), ShardDataset(tmp_path / "node1")  # a URL and a data dir
    try:
        assert node0.keys == ["mask", "x", "y"] and len(node0) + len(node1) == 997
        for local, row in [(0, 0), (331, 331), (332, 664), (len(node0) - 1, 996)]:
            mask, x, y = node0[local]
            assert torch.equal(x, tensors["x"][row]) and torch.equal(y, tensors["y"][row])
            assert torch.equal(mask, tensors["mask"][row])
        loader = torch.utils.data.DataLoader(node1, batch_size=100)
        xs = torch.cat([x for _, x, _ in loader])
        assert torch.equal(xs, tensors["x"][332:664])
        every = torch.stack([node0[i][1] for i in range(len(node0))])  # block by block, cached
        assert torch.equal(every, torch.cat([tensors["x"][:332], tensors["x"][664:]]))
    finally:
        node0.close()

    out = fetch(urls[0], tmp_path / "out")
    assert out.written == ["digits-shard-00000.safetensors", "digits-shard-00002.safetensors"]
    shard2 = safetensors.torch.load_file(str(tmp_path / "out" / out.written[1]))
    assert torch.equal(shard2["y"], tensors["y"][664:]) and torch.equal(shard2["mask"], tensors["mask"][664:])


def test_tampered_item_is_caught_and_resent_alone(servers: list[ServerThread], tmp_path: Path) -> None:
    src = tmp_path / "docs"
    (src / "a").mkdir(parents=True)
    for i in range(10):
        (src / "a" / f"{i}.txt").write_bytes(bytes([i]) * (1000 + i))
    urls = [srv.url for srv in servers]
    assert scatter(src, urls).ok
    plan = make_plan(src, 2)
    victim = plan.shards[1].items[0]
    with connect(urls[1]) as client:  # same size, one byte different: only a hash tells them apart
        bad = bytearray(victim.source.read_bytes())
        bad[0] ^= 1
        client.put(victim.name, torch.frombuffer(bad, dtype=torch.uint8))
        client.put("docs/shard-00001/files/a/stray.txt", torch.zeros(3, dtype=torch.uint8))

    reader = ShardDataset(urls[1])
    try:
        index = next(i for i, item in enumerate(reader.items) if item["name"] == victim.name)
        with pytest.raises(VerificationFailed):
            reader[index]
    finally:
        reader.close()

    again = scatter(src, urls)
    assert again.ok
    node = again.nodes[1]
    assert (node.sent_items, node.skipped_items, node.pruned) == (1, len(plan.shards[1].items) - 1, 1)
    assert again.nodes[0].sent_items == 0
    fresh = ShardDataset(urls[1])
    try:
        assert fresh[index][1].numpy().tobytes() == victim.source.read_bytes()
    finally:
        fresh.close()


def test_a_shard_more_takes_only_its_files_and_a_shard_less_is_dropped(
    servers: list[ServerThread], tmp_path: Path
) -> None:
    src = tmp_path / "many"
    src.mkdir()
    for i in range(40):
        (src / f"{i:02d}.txt").write_bytes(bytes([i]) * (100 + i))
    urls = [srv.url for srv in servers]
    assert scatter(src, urls, shards=4).ok
    moving = [f"{i:02d}.txt" for i in range(40) if assign_shard(f"{i:02d}.txt", 5) == 4]
    assert 0 < len(moving) < 40 / 5 * 2

    # Another shard count is another plan: without replace=True nothing is sent (DatasetConflict).
    grown = scatter(src, urls, shards=5, replace=True)  # shard 4 (on node 0) takes its files from the others
    assert grown.ok and sum(n.sent_items for n in grown.nodes) == len(moving) == grown.nodes[0].sent_items
    assert sum(n.pruned for n in grown.nodes) == len(moving)

    shrunk = scatter(src, urls, shards=4, replace=True)  # back: the files return, shard 4 and its manifest go
    assert shrunk.ok and sum(n.sent_items for n in shrunk.nodes) == len(moving)
    assert sum(n.pruned for n in shrunk.nodes) == len(moving) + 1  # its files, and its manifest
    with connect(urls[0]) as client:
        assert not client.list("many/shard-00004/")
    held = []
    for url in urls:
        with ShardDataset(url) as ds:
            assert [s.index for s in ds.shards.shards] == [s for s in range(4) if urls[s % 2] == url]
            held += [path for path, _ in ds]
    assert sorted(held) == [f"{i:02d}.txt" for i in range(40)]


async def _conn(url: str) -> FramedTransport:
    conn = await open_transport(Address.parse(url), TransportOptions(5.0, 5.0))
    assert isinstance(conn, FramedTransport)
    return conn


def test_digest_answers_what_is_held_and_refuses_bad_requests(servers: list[ServerThread]) -> None:
    import asyncio

    url = servers[0].url
    data = torch.arange(300_000, dtype=torch.int32)  # 1.2 MB: hashed off the event loop
    with connect(url) as client:
        client.put("d/big", data)
        client.put("d/small", torch.tensor([1.5, 2.5]))

    async def check() -> None:
        conn = await _conn(url)
        try:
            found = await fetch_digests(conn, ["d/big", "d/missing", "d/small", "d/big"])
            assert sorted(found) == ["d/big", "d/small"]
            assert found["d/big"].value == checksum(ChecksumKind.XXH3_64, data.numpy().tobytes())
            assert found["d/big"].meta.shape == (300_000,) and found["d/big"].meta.dtype == torch.int32
            crc = await fetch_digests(conn, ["d/small"], ChecksumKind.CRC32C)
            raw = torch.tensor([1.5, 2.5]).numpy().tobytes()
            assert crc["d/small"].value == checksum(ChecksumKind.CRC32C, raw)
            with pytest.raises(ProtocolError, match="checksum kind 9"):
                await conn.call(Opcode.DIGEST, b"\x09" + wm.encode_names(["d/big"]), what="a bad digest")
            assert await fetch_digests(conn, ["d/small"])  # the connection and the server go on
        finally:
            await conn.close()

    asyncio.run(check())


def test_nodes_that_cannot_take_a_shard_fail_alone_with_a_clear_error(
    servers: list[ServerThread], tmp_path: Path
) -> None:
    (tmp_path / "set").mkdir()
    for i in range(4):
        (tmp_path / "set" / f"{i}.txt").write_text(str(i) * 100)
    with ServerThread() as plain:  # no DigestService: it cannot prove what it holds
        report = scatter(tmp_path / "set", [servers[0].url, plain.url])
    good, no_digest = report.nodes
    assert good.verified and good.error is None
    assert not no_digest.verified and "DIGEST" in str(no_digest.error)
    with pytest.raises(ValueError, match="not grpc://"):  # before anything is sent anywhere
        scatter(tmp_path / "set", [servers[0].url, "grpc://127.0.0.1:1"])

    result = CliRunner().invoke(cli.main, ["dataset", "scatter", str(tmp_path / "set"), "--by", "rows",
                                           "--to", servers[0].url])  # fmt: skip
    assert result.exit_code == 1 and "no .safetensors or .npy files" in result.output
    result = CliRunner().invoke(cli.main, ["dataset", "scatter", str(tmp_path / "set"), "--to", "grpc://h:1"])
    assert result.exit_code == 2 and "not grpc://" in result.output
