from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChecksumKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_UNSPECIFIED: _ClassVar[ChecksumKind]
    XXH3_64: _ClassVar[ChecksumKind]
    CRC32C: _ClassVar[ChecksumKind]
CHECKSUM_UNSPECIFIED: ChecksumKind
XXH3_64: ChecksumKind
CRC32C: ChecksumKind

class TensorRequest(_message.Message):
    __slots__ = ("tensor_name", "data", "shape", "dtype")
    TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    tensor_name: str
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, tensor_name: _Optional[str] = ..., data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class TensorResponse(_message.Message):
    __slots__ = ("success", "message", "data", "shape", "dtype")
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    success: bool
    message: str
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, success: _Optional[bool] = ..., message: _Optional[str] = ..., data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    version: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("tensor", "data", "checksum_kind", "checksum", "manifest", "part")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_KIND_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    tensor: TensorInfo
    data: bytes
    checksum_kind: ChecksumKind
    checksum: int
    manifest: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    part: PartHead
    def __init__(self, tensor: _Optional[_Union[TensorInfo, _Mapping]] = ..., data: _Optional[bytes] = ..., checksum_kind: _Optional[_Union[ChecksumKind, str]] = ..., checksum: _Optional[int] = ..., manifest: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., part: _Optional[_Union[PartHead, _Mapping]] = ...) -> None: ...

class PartHead(_message.Message):
    __slots__ = ("prefix", "txn", "index", "count", "timeout_ms")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    TXN_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    txn: bytes
    index: int
    count: int
    timeout_ms: int
    def __init__(self, prefix: _Optional[str] = ..., txn: _Optional[bytes] = ..., index: _Optional[int] = ..., count: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class GenerationInfo(_message.Message):
    __slots__ = ("prefix", "number", "digest", "names", "nbytes")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    number: int
    digest: bytes
    names: _containers.RepeatedScalarFieldContainer[str]
    nbytes: int
    def __init__(self, prefix: _Optional[str] = ..., number: _Optional[int] = ..., digest: _Optional[bytes] = ..., names: _Optional[_Iterable[str]] = ..., nbytes: _Optional[int] = ...) -> None: ...

class RangesRequest(_message.Message):
    __slots__ = ("name", "at", "offsets", "lengths", "chunk_bytes", "checksum_kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    at: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    chunk_bytes: int
    checksum_kind: ChecksumKind
    def __init__(self, name: _Optional[str] = ..., at: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., chunk_bytes: _Optional[int] = ..., checksum_kind: _Optional[_Union[ChecksumKind, str]] = ...) -> None: ...

class ManifestRequest(_message.Message):
    __slots__ = ("prefix", "at")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    at: int
    def __init__(self, prefix: _Optional[str] = ..., at: _Optional[int] = ...) -> None: ...

class ManifestTensor(_message.Message):
    __slots__ = ("tensor", "checksums")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    tensor: TensorInfo
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tensor: _Optional[_Union[TensorInfo, _Mapping]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class ManifestReply(_message.Message):
    __slots__ = ("generation", "chunk_bytes", "checksum_kind", "tensors")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_KIND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    generation: GenerationInfo
    chunk_bytes: int
    checksum_kind: ChecksumKind
    tensors: _containers.RepeatedCompositeFieldContainer[ManifestTensor]
    def __init__(self, generation: _Optional[_Union[GenerationInfo, _Mapping]] = ..., chunk_bytes: _Optional[int] = ..., checksum_kind: _Optional[_Union[ChecksumKind, str]] = ..., tensors: _Optional[_Iterable[_Union[ManifestTensor, _Mapping]]] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("prefix", "number", "milliseconds")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    MILLISECONDS_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    number: int
    milliseconds: int
    def __init__(self, prefix: _Optional[str] = ..., number: _Optional[int] = ..., milliseconds: _Optional[int] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("granted_ms", "oldest")
    GRANTED_MS_FIELD_NUMBER: _ClassVar[int]
    OLDEST_FIELD_NUMBER: _ClassVar[int]
    granted_ms: int
    oldest: int
    def __init__(self, granted_ms: _Optional[int] = ..., oldest: _Optional[int] = ...) -> None: ...

class PutReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("names", "chunk_bytes", "checksum_kind")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_KIND_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    chunk_bytes: int
    checksum_kind: ChecksumKind
    def __init__(self, names: _Optional[_Iterable[str]] = ..., chunk_bytes: _Optional[int] = ..., checksum_kind: _Optional[_Union[ChecksumKind, str]] = ...) -> None: ...

class NamesRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("prefix", "limit")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    limit: int
    def __init__(self, prefix: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class TensorList(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
