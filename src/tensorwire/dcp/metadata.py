"""A DCP checkpoint's metadata as tensorwire stores it (no sockets): DCP's ``Metadata`` and where
each item lives, written as JSON, and read back as any peer input is: every field checked before
a ``Metadata`` is built, and every chunk checked against the tensors the checkpoint's generation
actually holds (``check_stored``). Nothing here is ever unpickled.

What the document holds (``<prefix>/_metadata``, UTF-8 JSON)::

    {"format": "tensorwire.dcp/1", "checkpoint_id": "...", "save_id": "...", "version": "1.0.0",
     "modules": [...], "parts": 5,
     "planner_data": {fqn: [path, ...]} | null,     # DefaultSavePlanner's flatten mappings
     "tensors": {fqn: {"dtype": "float32", "size": [8, 6],
                       "chunks": [{"offsets": [0, 0], "sizes": [2, 6], "key": "r0/0"}, ...]}},
     "bytes": {fqn: {"key": "r1/3", "nbytes": 812}}}

``key`` names a tensor under the checkpoint's prefix: ``r<part>/<n>``, the n-th item the rank of
data part ``part`` wrote; a chunk is stored as a tensor of its own dtype and sizes, a byte item as
a uint8 tensor of ``nbytes``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tensorwire.errors import InvalidTensor, LayoutMismatch
from tensorwire.sharded.layout import Box, ShardLayout, Stored, check_tiling
from tensorwire.types import TensorMeta
from tensorwire.wire.dtypes import dtype_from_name, dtype_name

FORMAT = "tensorwire.dcp/1"
METADATA_KEY = "_metadata"  # the document's key under the checkpoint's prefix
MAX_DOCUMENT_BYTES = 256 << 20
MAX_ITEMS = 1 << 20  # tensors and byte items in one checkpoint
MAX_CHUNKS = 1 << 16  # chunks of one tensor
MAX_DIMS = 32
MAX_PATH = 64  # elements of one planner_data path
MAX_TEXT = 4096  # characters of one free-form string (ids, versions, module names)
_KEY = re.compile(r"r(0|[1-9][0-9]{0,5})/(0|[1-9][0-9]{0,8}|_empty)")


@dataclass(frozen=True, slots=True)
class StoredItem:
    """Where one DCP item lives: tensor ``key`` under the checkpoint's prefix, of ``dtype`` and
    ``shape`` (a chunk's sizes; ``(nbytes,)`` uint8 for a byte item). DCP's ``WriteResult``
    carries it from the rank that wrote it to the coordinator (``storage_data``)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def empty_key(part: int) -> str:
    """The key of the empty tensor a part with no items carries (every part carries one)."""
    return f"r{part}/_empty"


# -- writing ---------------------------------------------------------------------------------------
def encode(
    metadata: Metadata, items: Mapping[MetadataIndex, StoredItem], *, checkpoint_id: str, parts: int
) -> bytes:
    """The document of ``metadata`` whose items were stored as ``items`` (every rank's
    ``WriteResult.storage_data``, by index). InvalidTensor if an item of the metadata was not
    written, or if ``planner_data`` is not the flatten mappings JSON can hold."""
    tensors: dict[str, Any] = {}
    blobs: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            item = _written(items, MetadataIndex(fqn))
            blobs[fqn] = {"key": item.key, "nbytes": item.nbytes}
            continue
        chunks = []
        for chunk in md.chunks:
            item = _written(items, MetadataIndex(fqn, chunk.offsets))
            chunks.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes), "key": item.key})
        tensors[fqn] = {"dtype": dtype_name(md.properties.dtype), "size": list(md.size), "chunks": chunks}
    meta = metadata.storage_meta
    doc = {
        "format": FORMAT,
        "checkpoint_id": checkpoint_id,
        "save_id": None if meta is None else meta.save_id,
        "modules": [] if meta is None else list(meta.modules),
        "version": metadata.version,
        "parts": parts,
        "planner_data": _planner_data_out(metadata.planner_data),
        "tensors": tensors,
        "bytes": blobs,
    }
    return json.dumps(doc, sort_keys=True).encode()


def _written(items: Mapping[MetadataIndex, StoredItem], index: MetadataIndex) -> StoredItem:
    item = items.get(index)
    if not isinstance(item, StoredItem):
        raise InvalidTensor(f"{index.fqn!r} (offset {index.offset}) is in the plan but no rank wrote it")
    return item


def _planner_data_out(data: object) -> dict[str, list[str | int]] | None:
    if data is None:
        return None
    if isinstance(data, dict) and all(
        isinstance(k, str) and isinstance(v, tuple | list) and all(type(e) in (str, int) for e in v)
        for k, v in data.items()
    ):
        return {k: list(v) for k, v in data.items()}
    raise InvalidTensor(
        f"planner_data of type {type(data).__name__} cannot be stored: tensorwire.dcp keeps a"
        " DefaultSavePlanner's flatten mappings (fqn -> path of str and int), nothing pickled"
    )


# -- reading ---------------------------------------------------------------------------------------
def decode(data: bytes, *, checkpoint_id: str) -> tuple[Metadata, dict[MetadataIndex, StoredItem], int]:
    """DCP's ``Metadata``, where each item lives and how many parts the save had, from a document
    a peer stored: every field
    checked (types, counts, dtypes, dimensions; each tensor's chunks lie inside it, overlap nowhere
    and leave no gap; no two items share a stored tensor; the checkpoint id is the one asked for),
    LayoutMismatch otherwise. Never more than JSON."""
    doc = _document(data)
    if doc.get("checkpoint_id") != checkpoint_id:
        raise LayoutMismatch(
            f"the metadata under checkpoint {checkpoint_id!r} was written for checkpoint"
            f" {_short(doc.get('checkpoint_id'))}: refused (another job's checkpoint)"
        )
    parts = doc.get("parts")
    if type(parts) is not int or not 2 <= parts <= 1 << 20:
        raise LayoutMismatch(f"the metadata names {_short(parts)} parts")
    tensors, blobs = doc.get("tensors"), doc.get("bytes")
    if not isinstance(tensors, dict) or not isinstance(blobs, dict) or len(tensors) + len(blobs) > MAX_ITEMS:
        raise LayoutMismatch(f"the metadata's tensors and bytes must be objects of at most {MAX_ITEMS} items")
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    items: dict[MetadataIndex, StoredItem] = {}
    for fqn, entry in tensors.items():
        state[fqn] = _decode_tensor(fqn, entry, parts, items)
    for fqn, entry in blobs.items():
        if fqn in state:
            raise LayoutMismatch(f"{fqn!r} is both a tensor and a byte item")
        state[fqn] = BytesStorageMetadata()
        _add(items, MetadataIndex(fqn), _decode_blob(fqn, entry, parts))
    keys = [item.key for item in items.values()]
    if len(set(keys)) != len(keys):
        raise LayoutMismatch("two items of the metadata name one stored tensor")
    storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=_text(doc, "save_id"),
                               modules=_texts(doc.get("modules")))  # fmt: skip
    metadata = Metadata(
        state_dict_metadata=state,
        planner_data=_planner_data_in(doc.get("planner_data")),
        storage_data=items,
        storage_meta=storage_meta,
        version=_text(doc, "version"),
    )
    return metadata, items, parts


def check_stored(
    items: Mapping[MetadataIndex, StoredItem], metas: Mapping[str, TensorMeta], prefix: str, parts: int
) -> None:
    """LayoutMismatch unless the generation (``metas``, by full name) holds every item the
    metadata names with the dtype, shape and size it says, and nothing else but the metadata
    itself and the empty markers of parts that wrote nothing: a reader never reads a byte that is
    not what the metadata describes."""
    expected = {f"{prefix}/{METADATA_KEY}"}
    for index, item in items.items():
        name = f"{prefix}/{item.key}"
        expected.add(name)
        meta = metas.get(name)
        if meta is None:
            raise LayoutMismatch(f"{index.fqn!r}: the metadata names {item.key!r}, which no rank wrote")
        if meta.dtype != item.dtype or tuple(meta.shape) != item.shape or meta.nbytes != item.nbytes:
            raise LayoutMismatch(
                f"{index.fqn!r}: {item.key!r} is stored as {dtype_name(meta.dtype)} {list(meta.shape)}"
                f" ({meta.nbytes} bytes), not as the metadata says"
                f" ({dtype_name(item.dtype)} {list(item.shape)})"
            )
    markers = {f"{prefix}/{empty_key(p)}" for p in range(parts)}
    extra = sorted(n for n in metas if n not in expected and not (n in markers and metas[n].nbytes == 0))
    if extra:
        raise LayoutMismatch(
            f"the checkpoint holds {len(extra)} tensors its metadata does not name (e.g. {extra[0]!r})"
        )


def _document(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_DOCUMENT_BYTES:
        raise LayoutMismatch(f"checkpoint metadata of {len(data)} bytes: at most {MAX_DOCUMENT_BYTES}")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise LayoutMismatch(
            f"the checkpoint's metadata is not JSON (not written by tensorwire.dcp): {exc}"
        ) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise LayoutMismatch(f"the checkpoint's metadata is not format {FORMAT!r}")
    return doc


def _decode_tensor(
    fqn: str, entry: object, parts: int, items: dict[MetadataIndex, StoredItem]
) -> TensorStorageMetadata:
    if not isinstance(entry, dict):
        raise LayoutMismatch(f"{fqn!r}: its metadata entry is not an object")
    dtype = _dtype(fqn, entry.get("dtype"))
    size = _ints(fqn, "size", entry.get("size"))
    chunks = entry.get("chunks")
    if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS:
        raise LayoutMismatch(f"{fqn!r}: chunks must be a list of at most {MAX_CHUNKS}")
    boxes: list[Stored] = []
    out: list[ChunkStorageMetadata] = []
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise LayoutMismatch(f"{fqn!r}: a chunk entry is not an object")
        offsets, sizes = _ints(fqn, "offsets", chunk.get("offsets")), _ints(fqn, "sizes", chunk.get("sizes"))
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise LayoutMismatch(f"{fqn!r}: chunk {offsets}+{sizes} does not have {len(size)} dimensions")
        key = _key(fqn, chunk.get("key"), parts)
        boxes.append(Stored(Box(offsets, sizes), 0, key))
        out.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        _add(items, MetadataIndex(fqn, offsets), StoredItem(key, dtype, sizes))
    check_tiling(ShardLayout(fqn, dtype, size, boxes=tuple(boxes)))  # inside, no overlap, no gap
    return TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(size), chunks=out)


def _decode_blob(fqn: str, entry: object, parts: int) -> StoredItem:
    if not isinstance(entry, dict):
        raise LayoutMismatch(f"{fqn!r}: its metadata entry is not an object")
    nbytes = entry.get("nbytes")
    if type(nbytes) is not int or not 0 <= nbytes < 1 << 40:
        raise LayoutMismatch(f"{fqn!r}: nbytes {_short(nbytes)} is not a size")
    return StoredItem(_key(fqn, entry.get("key"), parts), torch.uint8, (nbytes,))


def _add(items: dict[MetadataIndex, StoredItem], index: MetadataIndex, item: StoredItem) -> None:
    if index in items:
        raise LayoutMismatch(f"{index.fqn!r}: two chunks at offset {list(index.offset or ())}")
    items[index] = item


def _key(fqn: str, key: object, parts: int) -> str:
    match = _KEY.fullmatch(key) if isinstance(key, str) else None
    if match is None or match.group(2) == "_empty" or int(match.group(1)) >= parts - 1:
        raise LayoutMismatch(f"{fqn!r}: {_short(key)} is not the key of a data part's item")
    return str(key)


def _dtype(fqn: str, given: object) -> torch.dtype:
    try:
        if isinstance(given, str):
            return dtype_from_name(given)
    except InvalidTensor:
        pass
    raise LayoutMismatch(f"{fqn!r}: dtype {_short(given)} is not one tensorwire knows")


def _ints(fqn: str, what: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise LayoutMismatch(f"{fqn!r}: {what} must be a list of at most {MAX_DIMS} integers")
    if not all(type(v) is int and 0 <= v < 1 << 62 for v in value):
        raise LayoutMismatch(f"{fqn!r}: {what} must be non-negative integers, not {_short(value)}")
    return tuple(value)


def _text(doc: Mapping[str, Any], name: str) -> str | None:
    value = doc.get(name)
    if value is None or (isinstance(value, str) and len(value) <= MAX_TEXT):
        return value
    raise LayoutMismatch(f"the metadata's {name} is not a short string")


def _texts(value: object) -> list[str]:
    if (
        isinstance(value, list)
        and len(value) <= MAX_ITEMS
        and all(isinstance(v, str) and len(v) <= MAX_TEXT for v in value)
    ):
        return list(value)
    raise LayoutMismatch("the metadata's modules are not a list of short strings")


def _planner_data_in(value: object) -> dict[str, tuple[str | int, ...]] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_ITEMS:
        raise LayoutMismatch("the metadata's planner_data is not an object")
    out: dict[str, tuple[str | int, ...]] = {}
    for fqn, path in value.items():
        if not isinstance(path, list) or len(path) > MAX_PATH or not all(type(e) in (str, int) for e in path):
            raise LayoutMismatch(f"{fqn!r}: its planner_data path is not a list of strings and integers")
        out[fqn] = tuple(path)
    return out


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["FORMAT", "METADATA_KEY", "StoredItem", "check_stored", "decode", "empty_key", "encode"]
