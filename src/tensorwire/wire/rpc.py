"""The gRPC encoding of tensors: ``TensorInfo`` <-> ``TensorMeta``, chunk sizes, message limits,
and the trailing-metadata key that carries a tensorwire error code. Shared by the gRPC transport
and the gRPC server; the schema is proto/tensorwire/v1/tensor_service.proto."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

from google.protobuf.message import DecodeError

from tensorwire.errors import ProtocolError
from tensorwire.types import ChunkSums, Generation, GenerationManifest, TensorMeta
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.wire import generations as wg
from tensorwire.wire.dtypes import dtype_from_name, dtype_name

SERVICE = "tensor_service.TensorService"
ERROR_KEY = "tensorwire-error"  # trailing metadata: the tensorwire ErrorCode of a failed call
# Chunk sizes measured fastest through grpcio on a 2-core loopback: a client's stream of Put
# messages peaks at 256 KiB (1 MiB: -40%), a server's stream of Get answers at 1 MiB.
RPC_CHUNK_BYTES = 256 << 10
RPC_GET_CHUNK_BYTES = 1 << 20
# The unary calls carry a whole tensor in one message; larger tensors must use Put / Get.
UNARY_MAX_BYTES = 256 << 20


def pb_kind(kind: int) -> pb.ChecksumKind:
    """A checksum kind as the generated enum type (the numbers are the same; see wire/checksum)."""
    return cast("pb.ChecksumKind", int(kind))


def info_of(meta: TensorMeta) -> pb.TensorInfo:
    return pb.TensorInfo(
        name=meta.name,
        dtype=dtype_name(meta.dtype),
        shape=meta.shape,
        nbytes=meta.nbytes,
        version=meta.version,
    )


def meta_of(info: pb.TensorInfo) -> TensorMeta:
    """The metadata a ``TensorInfo`` describes; InvalidTensor if dtype, shape and size disagree."""
    meta = TensorMeta(info.name, dtype_from_name(info.dtype), tuple(info.shape), info.nbytes, info.version)
    meta.check_size()
    return meta


def generation_info(gen: Generation) -> pb.GenerationInfo:
    return pb.GenerationInfo(
        prefix=gen.prefix, number=gen.number, digest=gen.digest, names=gen.names, nbytes=gen.nbytes
    )


def generation_of(info: pb.GenerationInfo) -> Generation:
    return Generation(info.prefix, info.number, bytes(info.digest), tuple(info.names), info.nbytes)


def part_info(head: wg.PartHead) -> pb.PartHead:
    return pb.PartHead(
        prefix=head.prefix, txn=head.txn, index=head.index, count=head.count, timeout_ms=head.timeout_ms
    )


def part_head(info: pb.PartHead) -> wg.PartHead:
    """The head a PublishPart's first chunk carries; ProtocolError unless it names a part of a
    transaction (as ``wg.decode_part_head``) by a 16-byte id."""
    if len(info.txn) != wg.TXN_BYTES:
        raise ProtocolError(f"a transaction id is {wg.TXN_BYTES} bytes, not {len(info.txn)}")
    if not info.count or info.index >= info.count:
        raise ProtocolError(f"part {info.index} of {info.count} is no part of a transaction")
    return wg.PartHead(info.prefix, bytes(info.txn), info.index, info.count, info.timeout_ms)


def manifest_reply(manifest: GenerationManifest) -> pb.ManifestReply:
    tensors = [pb.ManifestTensor(tensor=info_of(t.meta), checksums=t.checksums) for t in manifest.tensors]
    return pb.ManifestReply(
        generation=generation_info(manifest.generation),
        chunk_bytes=manifest.chunk_size,
        checksum_kind=pb_kind(manifest.checksum_kind),
        tensors=tensors,
    )


def manifest_of(reply: pb.ManifestReply) -> GenerationManifest:
    """The manifest a reply holds; InvalidTensor for a record whose dtype, shape and size disagree,
    ProtocolError for a chunk count that does not fit its tensor's size."""
    chunk = reply.chunk_bytes
    if not chunk:
        raise ProtocolError("a manifest with a chunk size of 0")
    tensors = []
    for entry in reply.tensors:
        meta = meta_of(entry.tensor)
        if len(entry.checksums) != -(-meta.nbytes // chunk):
            raise ProtocolError(f"the manifest gives {meta.name!r} {len(entry.checksums)} chunk checksums")
        tensors.append(ChunkSums(meta, tuple(entry.checksums)))
    return GenerationManifest(
        generation_of(reply.generation), chunk, int(reply.checksum_kind), tuple(tensors)
    )


def message_options(max_chunk_bytes: int) -> list[tuple[str, int]]:
    """grpcio channel/server options: messages up to a unary tensor or a chunk, whichever is larger."""
    message = min(max(UNARY_MAX_BYTES, max_chunk_bytes + (1 << 20)), (1 << 31) - 1)
    return [("grpc.max_receive_message_length", message), ("grpc.max_send_message_length", message)]


# -- Chunk messages by hand ------------------------------------------------------------------------
# grpcio hands a handler's bytes to the network as they are, so Put and Get skip the generated
# Chunk class: building one copies its data into the message and serializing copies it again.
# Encoding the few fields of a Chunk here puts tensor bytes into exactly one ``bytes`` object on the
# way out, and reads them in place (a memoryview) on the way in. The bytes on the wire are the
# standard protobuf encoding of ``Chunk``, so clients generated from the schema read and write them.

_TENSOR, _DATA, _KIND, _CHECKSUM, _MANIFEST, _PART = 1, 2, 3, 4, 5, 6
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(
    data: memoryview | bytes,
    kind: int,
    checksum: int,
    tensor: pb.TensorInfo | None = None,
    part: pb.PartHead | None = None,
) -> bytes:
    """The wire bytes of a ``Chunk`` carrying ``data`` (copied once, here)."""
    parts: list[bytes | memoryview] = []
    if part is not None:
        raw = part.SerializeToString()
        parts += [b"\x32", _varint(len(raw)), raw]
    if tensor is not None:
        raw = tensor.SerializeToString()
        parts += [b"\x0a", _varint(len(raw)), raw]
    if len(data):
        parts += [b"\x12", _varint(len(data)), data]
    parts += [b"\x18", _varint(kind), b"\x20", _varint(checksum)]
    return b"".join(parts)


class RawChunk(NamedTuple):
    tensor: pb.TensorInfo | None
    data: memoryview
    kind: int
    checksum: int
    manifest: list[pb.TensorInfo]
    part: pb.PartHead | None = None


def decode_chunk(raw: bytes) -> RawChunk:
    """Parse the wire bytes of a ``Chunk``; ``data`` is a view into ``raw`` (no copy).
    ProtocolError for anything malformed: every length is checked against the bytes present."""
    view = memoryview(raw)
    tensor: pb.TensorInfo | None = None
    data = view[:0]
    kind = checksum = 0
    manifest: list[pb.TensorInfo] = []
    part: pb.PartHead | None = None
    pos = 0
    while pos < len(raw):
        key, pos = _read_varint(raw, pos)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _read_varint(raw, pos)
            if field == _KIND:
                kind = value
            elif field == _CHECKSUM:
                checksum = value
        elif wire == _LEN:
            size, pos = _read_varint(raw, pos)
            if pos + size > len(raw):
                raise ProtocolError("a Chunk field runs past the end of its message")
            body, pos = view[pos : pos + size], pos + size
            if field == _DATA:
                data = body
            elif field == _PART:
                part = _parse(pb.PartHead, body)
            elif field in (_TENSOR, _MANIFEST):
                info = _parse_info(body)
                if field == _TENSOR:
                    tensor = info
                else:
                    manifest.append(info)
        elif wire in (_I64, _I32):
            pos += 8 if wire == _I64 else 4
        else:
            raise ProtocolError(f"a Chunk has a field of unknown wire type {wire}")
    if pos > len(raw):
        raise ProtocolError("a Chunk ends in the middle of a field")
    return RawChunk(tensor, data, kind, checksum, manifest, part)


def _read_varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw) or shift > 63:
            raise ProtocolError("a Chunk has a truncated or oversized varint")
        byte = raw[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _parse_info(body: memoryview) -> pb.TensorInfo:
    info: pb.TensorInfo = _parse(pb.TensorInfo, body)
    return info


def _parse(message: Any, body: memoryview) -> Any:
    try:
        return message.FromString(bytes(body))
    except DecodeError as exc:
        raise ProtocolError(f"a Chunk carries a malformed {message.DESCRIPTOR.name}: {exc}") from exc
