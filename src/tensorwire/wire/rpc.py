"""The gRPC encoding of tensors: ``TensorInfo`` <-> ``TensorMeta``, chunk sizes, message limits,
and the trailing-metadata key that carries a tensorwire error code. Shared by the gRPC transport
and the gRPC server; the schema is proto/tensorwire/v1/tensor_service.proto."""

from __future__ import annotations

from typing import cast

from tensorwire.types import TensorMeta
from tensorwire.v1 import tensor_service_pb2 as pb
from tensorwire.wire.dtypes import dtype_from_name, dtype_name

ERROR_KEY = "tensorwire-error"  # trailing metadata: the tensorwire ErrorCode of a failed call
RPC_CHUNK_BYTES = 256 << 10  # measured fastest through grpcio here (1 MiB: -40%, 4 MiB: -60%)
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


def message_options(max_chunk_bytes: int) -> list[tuple[str, int]]:
    """grpcio channel/server options: messages up to a unary tensor or a chunk, whichever is larger."""
    message = min(max(UNARY_MAX_BYTES, max_chunk_bytes + (1 << 20)), (1 << 31) - 1)
    return [("grpc.max_receive_message_length", message), ("grpc.max_send_message_length", message)]
