"""The gRPC encodings of generations (wire/rpc.py): a PublishPart's head rides on a hand-encoded
Chunk and reads back as the generated class parses it; a manifest round-trips, and one whose
checksum counts do not fit its tensors, or a head that names no part, is refused."""

from __future__ import annotations

import os

import pytest
import torch

from tensorwire.errors import ProtocolError
from tensorwire.types import ChunkSums, Generation, GenerationManifest, TensorMeta
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.wire import generations as wg
from tensorwire.wire.rpc import (
    decode_chunk,
    encode_chunk,
    info_of,
    manifest_of,
    manifest_reply,
    part_head,
    part_info,
)


def test_a_part_head_rides_on_a_chunk_as_the_schema_encodes_it() -> None:
    head = wg.PartHead("p", os.urandom(16), 1, 3, 5000)
    meta = TensorMeta("p/t", torch.uint8, (4,), 4)
    raw = encode_chunk(b"abcd", 1, 7, info_of(meta), part_info(head))
    generated = pb.Chunk.FromString(raw)
    assert generated.part.txn == head.txn and generated.data == b"abcd" and generated.tensor.name == "p/t"
    chunk = decode_chunk(raw)
    assert chunk.part is not None and part_head(chunk.part) == head
    assert bytes(chunk.data) == b"abcd" and chunk.checksum == 7
    assert decode_chunk(encode_chunk(b"x", 1, 2)).part is None


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (pb.PartHead(prefix="p", txn=bytes(8), index=0, count=2), "16 bytes, not 8"),
        (pb.PartHead(prefix="p", txn=bytes(16), index=2, count=2), "part 2 of 2"),
        (pb.PartHead(prefix="p", txn=bytes(16), index=0, count=0), "part 0 of 0"),
    ],
)
def test_a_head_that_names_no_part_is_refused(head: pb.PartHead, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        part_head(head)


def test_a_manifest_round_trips_and_a_wrong_checksum_count_is_refused() -> None:
    meta = TensorMeta("p/t", torch.float32, (3, 4), 48, 2)
    gen = Generation("p", 2, bytes(range(16)), ("p/t",), 48)
    manifest = GenerationManifest(gen, 32, 1, (ChunkSums(meta, (11, 12)),))
    reply = manifest_reply(manifest)
    assert manifest_of(pb.ManifestReply.FromString(reply.SerializeToString())) == manifest
    del reply.tensors[0].checksums[1]
    with pytest.raises(ProtocolError, match="1 chunk checksums"):
        manifest_of(reply)
    reply.chunk_bytes = 0
    with pytest.raises(ProtocolError, match="chunk size of 0"):
        manifest_of(reply)
