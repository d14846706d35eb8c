"""One tensor in one safetensors file: the format of a data directory's files (store/persist.py
keeps them, store/generation_disk.py writes generations with it, dataset/reader.py reads shards).

A file is ``<sha256(name as UTF-8) hex>.safetensors`` (``file_name``): names may hold ``/`` and any
unicode, so a name is never used as a path. Each file is a valid safetensors file (8-byte
little-endian header length, JSON header padded with spaces to a multiple of 8 bytes, raw data)
holding exactly one tensor under its real name. ``__metadata__`` records ``tensorwire.version``,
``tensorwire.dtype`` (torch dtype name) and ``tensorwire.shape`` (JSON list). Dtypes safetensors
knows are written with their real dtype and shape, so ``safetensors.torch.load_file`` returns the
right tensor; the others (complex32, complex128, float8 fnuz/e8m0, float4, bits*) are written as
``U8`` of shape ``[nbytes]`` and restored from the metadata. Bytes are written as they are in
memory, which is the safetensors (little-endian) layout on every platform torch ships for.

Reading (``read_file``) checks a file like any input from outside: one tensor, the name its file
name says, tensorwire's metadata, and a dtype and shape that agree with it.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import struct
from typing import Any

import safetensors
import safetensors.torch
import torch

from tensorwire.errors import InvalidTensor, PersistenceError
from tensorwire.types import TensorMeta
from tensorwire.wire.dtypes import dtype_from_name, dtype_name

SUFFIX = ".safetensors"
META_VERSION = "tensorwire.version"
META_DTYPE = "tensorwire.dtype"
META_SHAPE = "tensorwire.shape"

# torch dtype name -> safetensors dtype code, for the dtypes written with their real dtype. The fnuz
# float8s are left out on purpose: older safetensors releases cannot read them.
_SAFETENSORS_CODES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "complex64": "C64",
}


def _native_codes() -> dict[torch.dtype, str]:
    """The dtypes this torch has and the installed safetensors can load, with their codes."""
    # A code the installed safetensors cannot load falls back to U8, so our own files always reload.
    known: dict[str, Any] | None = getattr(safetensors.torch, "_TYPES", None)
    codes: dict[torch.dtype, str] = {}
    for torch_name, code in _SAFETENSORS_CODES.items():
        dtype = getattr(torch, torch_name, None)
        if isinstance(dtype, torch.dtype) and (known is None or known.get(code) == dtype):
            codes[dtype] = code
    return codes


_NATIVE_CODES = _native_codes()


def file_name(name: str) -> str:
    """The file (in the data directory) that holds the tensor called ``name``."""
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PersistenceError(f"tensor name {name!r} is not valid unicode: {exc}") from exc
    return hashlib.sha256(encoded).hexdigest() + SUFFIX


def encode_header(meta: TensorMeta) -> bytes:
    """The safetensors prefix (length + padded JSON header) of the file for ``meta``."""
    code = _NATIVE_CODES.get(meta.dtype)
    st_dtype, st_shape = (code, list(meta.shape)) if code else ("U8", [meta.nbytes])
    header = {
        "__metadata__": {
            META_VERSION: str(meta.version),
            META_DTYPE: dtype_name(meta.dtype),
            META_SHAPE: json.dumps(list(meta.shape)),
        },
        meta.name: {"dtype": st_dtype, "shape": st_shape, "data_offsets": [0, meta.nbytes]},
    }
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the spec allows trailing spaces; 8-alignment keeps data aligned
    return struct.pack("<Q", len(raw)) + raw


def check_item(meta: TensorMeta, data: memoryview) -> None:
    """Refuse, before anything touches the disk, an item that could not be read back as given."""
    if meta.name == "__metadata__":
        raise InvalidTensor("a tensor called '__metadata__' cannot be stored in a safetensors file")
    dtype_from_name(dtype_name(meta.dtype))  # raises InvalidTensor for dtypes load() would refuse
    meta.check_size()
    if data.nbytes != meta.nbytes or not data.c_contiguous:
        raise InvalidTensor(
            f"{meta.name!r}: expected {meta.nbytes} contiguous bytes, got {data.nbytes} "
            f"(contiguous={data.c_contiguous})"
        )
    if meta.version < 0:
        raise InvalidTensor(f"{meta.name!r}: negative version {meta.version}")


def read_file(path: pathlib.Path) -> tuple[TensorMeta, torch.Tensor]:
    """One stored tensor: its meta and bytes (1-D uint8); PersistenceError naming ``path`` if bad."""
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            metadata: dict[str, str] | None = f.metadata()
            keys: list[str] = list(f.keys())
            if len(keys) != 1:
                raise PersistenceError(f"corrupt {path}: holds {len(keys)} tensors, expected 1")
            stored: torch.Tensor = f.get_tensor(keys[0])
    except PersistenceError:
        raise
    except OSError as exc:
        raise PersistenceError(f"cannot read {path}: {exc}") from exc
    except (safetensors.SafetensorError, ValueError, RuntimeError, TypeError) as exc:
        raise PersistenceError(f"corrupt {path}: {exc}") from exc
    name = keys[0]
    if path.name != file_name(name):
        raise PersistenceError(f"corrupt {path}: holds tensor {name!r}, whose file is {file_name(name)}")
    dtype, shape, version = _parse_metadata(path, metadata)
    data = _stored_bytes(path, stored, dtype, shape)
    meta = TensorMeta(name, dtype, shape, data.numel(), version)
    try:
        meta.check_size()
    except InvalidTensor as exc:
        raise PersistenceError(f"corrupt {path}: {exc}") from exc
    return meta, data


def _parse_metadata(
    path: pathlib.Path, metadata: dict[str, str] | None
) -> tuple[torch.dtype, tuple[int, ...], int]:
    """dtype, shape and version from a file's ``__metadata__``; PersistenceError if any is bad."""
    if not metadata or not {META_VERSION, META_DTYPE, META_SHAPE} <= metadata.keys():
        raise PersistenceError(f"corrupt {path}: no tensorwire metadata (not written by tensorwire?)")
    try:
        version = int(metadata[META_VERSION])
        dtype = dtype_from_name(metadata[META_DTYPE])
        shape = json.loads(metadata[META_SHAPE])
    except (ValueError, InvalidTensor) as exc:
        raise PersistenceError(f"corrupt {path}: bad tensorwire metadata: {exc}") from exc
    is_shape = isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
    if not is_shape or version < 0:
        raise PersistenceError(f"corrupt {path}: bad shape {shape!r} or version {version}")
    return dtype, tuple(shape), version


def _stored_bytes(
    path: pathlib.Path, stored: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """The raw bytes of ``stored`` as 1-D uint8, once its dtype/shape agree with the metadata."""
    if stored.dtype == dtype and tuple(stored.shape) == shape:
        # reshape(-1) first: a 0-dim tensor cannot be viewed as a dtype of another itemsize.
        return stored.reshape(-1).view(torch.uint8)
    # Dtypes without a safetensors code (or unknown to the safetensors that wrote the file) are raw U8.
    if stored.dtype == torch.uint8 and stored.dim() == 1:
        return stored
    raise PersistenceError(
        f"corrupt {path}: stored as {stored.dtype} {tuple(stored.shape)}, metadata says {dtype} {shape}"
    )
