"""The RDMA_* metadata blocks (docs/protocol.md §17) and the chunk checksums: round trips, and
refusal of what a lying peer could send (references out of range or twice, checksums that do not
cover a tensor's chunks, an engine session that is not host:port)."""

from __future__ import annotations

import importlib

import pytest
import torch

from tensorwire.errors import ProtocolError, RdmaUnavailable, TransportError
from tensorwire.transport import rdma_engine
from tensorwire.types import Limits, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import rdma as wr
from tensorwire.wire.checksum import ChecksumKind

META = TensorMeta("w", torch.float32, (1000,), 4000)


def _reader(block: bytes) -> wm.MetaReader:
    return wm.MetaReader(block, Limits())


def test_refs_round_trip_with_and_without_checksums() -> None:
    sums = wr.chunk_checksums(ChecksumKind.XXH3_64, memoryview(bytes(range(256)) * 16), 1024)
    refs = [wr.BufferRef(0, META, 0x1000, sums)]
    assert wr.decode_refs(_reader(wr.encode_refs(refs, with_checksums=True)), 1, 1024) == refs
    bare = [wr.BufferRef(0, META, 0x1000)]
    assert wr.decode_refs(_reader(wr.encode_refs(bare, with_checksums=False)), 1) == bare


@pytest.mark.parametrize(
    "refs",
    [
        [wr.BufferRef(1, META, 0x1000)],  # an item the request does not have
        [wr.BufferRef(0, META, 0x1000), wr.BufferRef(0, META, 0x2000)],  # one item twice
        [wr.BufferRef(0, META, 0)],  # no address
    ],
)
def test_lying_refs_are_refused(refs: list[wr.BufferRef]) -> None:
    with pytest.raises(ProtocolError):
        wr.decode_refs(_reader(wr.encode_refs(refs, with_checksums=False)), 1)


def test_checksums_must_cover_every_chunk_once() -> None:
    short = [wr.BufferRef(0, META, 0x1000, (1, 2))]  # 4000 bytes in 1024-byte chunks: 4 checksums
    with pytest.raises(ProtocolError, match="chunks one each"):
        wr.decode_refs(_reader(wr.encode_refs(short, with_checksums=True)), 1, 1024)


def test_bad_chunk_finds_the_first_damaged_chunk() -> None:
    data = bytearray(4000)
    sums = wr.chunk_checksums(ChecksumKind.XXH3_64, memoryview(data), 1024)
    assert wr.bad_chunk(ChecksumKind.XXH3_64, memoryview(data), 1024, sums) is None
    data[2100] ^= 1
    assert wr.bad_chunk(ChecksumKind.XXH3_64, memoryview(data), 1024, sums) == 2
    assert wr.bad_chunk(ChecksumKind.XXH3_64, memoryview(data), 1024, sums[:3]) == 0  # too few


def test_end_round_trips_commit_and_release() -> None:
    body = wr.encode_end(7, wr.End.COMMIT, 1024, [(1, 2, 3, 4)], [META])
    assert wr.decode_end(_reader(body)) == (7, wr.End.COMMIT, wr.Commit(1024, [(1, 2, 3, 4)], [META]))
    assert wr.decode_end(_reader(wr.encode_end(9, wr.End.RELEASE))) == (9, wr.End.RELEASE, None)
    with pytest.raises(ProtocolError, match="unknown action"):
        wr.decode_end(_reader(wr.encode_u64(9) + b"\x07"))


def test_attach_names_a_known_protocol_and_a_host_port_session() -> None:
    assert wr.decode_attach_request(_reader(wr.encode_attach_request("tcp"))) == "tcp"
    with pytest.raises(ProtocolError):
        wr.decode_attach_request(_reader(wr.encode_attach_request("carrier-pigeon")))
    answer = wr.Attach("10.0.0.5:15123", "rdma", 65536, 2**64 - 1)
    assert wr.decode_attach_answer(_reader(wr.encode_attach_answer(answer))) == answer
    with pytest.raises(ProtocolError, match="host:port"):
        wr.decode_attach_answer(_reader(wr.encode_attach_answer(wr.Attach("nowhere", "rdma", 1, 7))))


def test_the_topology_says_whether_there_are_rdma_devices() -> None:
    assert rdma_engine.rdma_devices('{"cpu:0": [[], []]}') == []  # what the engine says with none
    assert rdma_engine.rdma_devices('{"cpu:0": [["mlx5_0"], ["mlx5_1"]], "cuda:0": [["mlx5_0"], []]}') == [
        "mlx5_0",
        "mlx5_1",
    ]
    assert rdma_engine.rdma_devices("not json") == []


def test_the_protocol_asked_for_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(rdma_engine.PROTOCOL_ENV, raising=False)
    assert rdma_engine.requested_protocol() == "rdma"
    monkeypatch.setenv(rdma_engine.PROTOCOL_ENV, "TCP")
    assert rdma_engine.requested_protocol() == "tcp"
    monkeypatch.setenv(rdma_engine.PROTOCOL_ENV, "udp")
    with pytest.raises(ValueError, match="rdma, tcp"):
        rdma_engine.requested_protocol()


def test_without_the_engine_rdma_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine is an optional extra: loading it where it is missing (or where libibverbs.so.1
    is) raises RdmaUnavailable, a TransportError, naming both; the ImportError is its cause."""
    real = importlib.import_module

    def missing(name: str, *args: object) -> object:
        if name.startswith("mooncake"):
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(RdmaUnavailable, match=r"tensorwire\[rdma\].*libibverbs1") as caught:
        rdma_engine.Engine("127.0.0.1", "tcp")
    assert isinstance(caught.value, TransportError) and isinstance(caught.value.__cause__, ImportError)
