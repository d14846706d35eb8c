"""How a data set is cut into shards, what each shard's items are called on a node, and its manifest.

A plan is a pure function of the source (its files, their sizes, the tensors' shapes) and the
options, so a re-run after an interruption computes the same items under the same names, and can
skip those a node already holds.

- ``by="files"``: every file under the source folder is one item, sent as its raw bytes (a 1-D
  uint8 tensor) under ``<dataset>/shard-<k>/files/<relative path>``; fetching writes the same
  bytes back. Each file goes to the shard its relative path hashes to (``assign_shard``).
- ``by="rows"``: the source is tensors in ``.safetensors`` / ``.npy`` files that share their first
  dimension (samples x features, labels...): shard k gets rows ``[k*R/N, (k+1)*R/N)`` of every
  tensor, sent in blocks of at most ``block_bytes`` under ``<dataset>/shard-<k>/rows/<key>/<row>``.

Files are assigned by rendezvous (highest-random-weight) hashing: file ``rel`` goes to the shard
k with the highest ``xxh3_64(rel, seed=k)``. A file's shard depends on its path and the number of
shards only, never on the other files, so the assignment is stable: adding or removing a file
moves only that file, editing one re-sends only it, and going from N to N+1 shards moves only the
files whose new shard is N (about 1/(N+1) of them; nothing moves between the old shards). The cost
is balance: each shard gets an equal *expected* share, so counts vary like a binomial (about
sqrt(n/N) files around n/N), and bytes vary with the file sizes: a data set of a few huge files
can land unevenly, where packing by size (largest first onto the lightest shard, which this
module did before) kept loads within one file of each other but moved about half the files when
one was added. Bounded-load variants would even the bytes again, but make a file's shard depend on
the others, which is the instability this avoids. Rows (below) are split by index instead: a
sample has no name, and contiguous ranges are what ``ShardDataset`` reads by the block.

Each shard ends with ``<dataset>/shard-<k>/manifest``: JSON (a uint8 tensor) listing every item
with its dtype, shape, size and xxh3-64, written only once all of them are verified on the node.
It lists items, not the rule that placed them, so its format did not change with the assignment:
a node holding shards placed by size is re-planned by the next scatter like any other change
(each file whose shard differs is sent once to its new shard and pruned from the old one).

A plan's identity (``plan_identity``) is a digest of what it sends: its name, split, shard count
and keys, and for every item its name and size and its source file's size and modification time.
A re-run over an unchanged source has the same identity (so it resumes); another tree, an edited
one, or other options (``--shards``, ``--by``, ``--block-size``) have another (identity.py: such a
scatter needs ``--replace`` to overwrite a data set of the same name). Contents are not hashed
here (that would read the whole source twice): the modification time stands in for them, and the
source's host and path, which a scatter compares beside the identity (identity.py), tell apart
trees whose times were normalised.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import xxhash

from tensorwire.errors import InvalidName, InvalidTensor
from tensorwire.types import MiB
from tensorwire.wire.dtypes import dtype_name
from tensorwire.wire.names import validate_name

FORMAT = "tensorwire.dataset/1"
TENSOR_SUFFIXES = (".safetensors", ".npy")
Split = Literal["files", "rows"]
Expected = tuple[torch.dtype, tuple[int, ...], int]  # an item's dtype, shape and xxh3-64
# A data set's name may not have a component a shard's prefix has: "a/shard-00001" would lie inside
# the shards of "a", and a scatter of "a" with one shard would prune it as a shard left over.
_SHARD_PART = re.compile(r"(^|/)shard-\d+(/|$)")
IDENTITY_BYTES = 64  # the most characters an identity (a hex digest) has in a manifest
MAX_MANIFEST_BYTES = 1 << 30  # a manifest read from a server larger than this is refused


@dataclass(frozen=True, slots=True)
class Item:
    """One tensor of a shard: where its bytes come from and what it is called on the node."""

    name: str
    nbytes: int
    source: Path
    path: str | None = None  # files: the path relative to the source folder
    key: str | None = None  # rows: the tensor's key (its .npy stem, or its key in a .safetensors)
    tensor: str | None = None  # rows from a .safetensors: the key inside that file
    start: int = 0  # rows: [start, stop) of the source tensor's first dimension
    stop: int = 0
    mtime_ns: int = 0  # the source file's modification time (part of the plan's identity)

    def load(self) -> torch.Tensor:
        """The item's bytes as the tensor that is sent (contiguous, CPU)."""
        if self.key is None:
            raw = np.fromfile(self.source, dtype=np.uint8)
            return torch.from_numpy(raw)
        if self.tensor is not None:
            from safetensors import safe_open

            with safe_open(str(self.source), framework="pt") as f:
                part: torch.Tensor = f.get_slice(self.tensor)[self.start : self.stop]
            return part.contiguous()
        array = np.load(self.source, mmap_mode="r", allow_pickle=False)
        return torch.from_numpy(np.array(array[self.start : self.stop]))  # read from the mmap, writable


@dataclass(slots=True)
class Shard:
    index: int
    dataset: str
    items: list[Item] = field(default_factory=list)

    @property
    def prefix(self) -> str:
        return shard_prefix(self.dataset, self.index)

    @property
    def manifest_name(self) -> str:
        return self.prefix + "manifest"

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item in self.items)


@dataclass(slots=True)
class Plan:
    dataset: str
    by: Split
    shards: list[Shard]
    keys: list[str] = field(default_factory=list)  # rows: the tensors every row has, in order


def shard_prefix(dataset: str, index: int) -> str:
    return f"{dataset}/shard-{index:05d}/"


def make_plan(
    src: Path, shards: int, by: Split = "files", dataset: str | None = None, block_bytes: int = 64 * MiB
) -> Plan:
    """Cut ``src`` (a folder, or for rows also one tensor file) into ``shards`` shards."""
    if shards < 1:
        raise ValueError(f"a data set needs at least one shard, not {shards}")
    if not src.exists():
        raise FileNotFoundError(f"{src}: no such file or folder")
    name = validate_dataset_name(dataset or (src.stem if src.is_file() else src.resolve().name))
    if by == "files":
        return Plan(name, by, _deal_files(src, shards, name))
    if by == "rows":
        keys = _tensor_keys(src)
        return Plan(name, by, _split_rows(keys, shards, name, block_bytes), sorted(keys))
    raise ValueError(f"by must be 'files' or 'rows', not {by!r}")


def validate_dataset_name(name: str) -> str:
    """``name`` if a data set can be called so: a valid tensor name with no ``shard-N`` component
    (it would lie inside another data set's shards, where that one's scatter prunes)."""
    validate_name(name)
    if _SHARD_PART.search(name):
        raise InvalidName(f"a data set's name cannot have a 'shard-N' part (shards are named so): {name!r}")
    return name


def plan_identity(plan: Plan) -> str:
    """The plan's identity: a digest (hex) of its name, split, shard count, keys and every item's
    name and size with its source file's size and modification time (see the module doc)."""
    h = hashlib.blake2b(digest_size=16, person=b"tw-dataset-id")
    h.update(json.dumps([FORMAT, plan.dataset, plan.by, len(plan.shards), plan.keys]).encode())
    for shard in plan.shards:
        h.update(struct.pack("<Q", len(shard.items)))
        for item in shard.items:
            h.update(item.name.encode("utf-8", "surrogateescape") + b"\0")  # a name has no NUL
            h.update(struct.pack("<QQ", item.nbytes, item.mtime_ns))
    return h.hexdigest()


# -- by files ------------------------------------------------------------------------------------
def _deal_files(src: Path, count: int, dataset: str) -> list[Shard]:
    if not src.is_dir():
        raise NotADirectoryError(f"{src}: --by files needs a folder")
    files = sorted((p for p in src.rglob("*") if p.is_file()), key=lambda p: p.relative_to(src).as_posix())
    if not files:
        raise FileNotFoundError(f"{src}: no files to scatter")
    shards = [Shard(k, dataset) for k in range(count)]
    bad: list[str] = []
    for path in files:  # in path order, so each shard's items are sorted by name
        rel = path.relative_to(src).as_posix()
        shard = shards[assign_shard(rel, count)]
        name = f"{shard.prefix}files/{rel}"
        try:
            validate_name(name)
        except InvalidName as exc:
            bad.append(f"{rel!r} ({exc})")
            continue
        st = path.stat()
        shard.items.append(Item(name, st.st_size, path, path=rel, mtime_ns=st.st_mtime_ns))
    if bad:
        raise InvalidName(f"{len(bad)} file(s) cannot be named on a server: {', '.join(bad[:3])}")
    return shards


def assign_shard(key: str, shards: int) -> int:
    """The shard of ``key`` among ``shards``: the k with the highest xxh3-64 of ``key`` seeded with k
    (rendezvous hashing; ties, never seen in practice, go to the lowest k). A pure function of
    ``key`` and k, the same in every process and Python version (unlike the salted ``hash``)."""
    if shards < 1:
        raise ValueError(f"a data set needs at least one shard, not {shards}")
    data = key.encode("utf-8", "surrogateescape")  # a file name that is not UTF-8: its bytes
    return max(range(shards), key=lambda k: xxhash.xxh3_64_intdigest(data, seed=k))


# -- by rows -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Source:
    path: Path
    tensor: str | None  # the key inside a .safetensors file; None for .npy
    dtype: torch.dtype
    shape: tuple[int, ...]
    mtime_ns: int = 0

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


def _tensor_keys(src: Path) -> dict[str, _Source]:
    files = [src] if src.is_file() else sorted(p for p in src.iterdir() if p.suffix in TENSOR_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"{src}: no .safetensors or .npy files to split by rows")
    keys: dict[str, _Source] = {}
    for path in files:
        for key, source in _read_shapes(path):
            if key in keys:
                raise InvalidTensor(f"tensor {key!r} is in both {keys[key].path} and {path}")
            validate_name(key)
            keys[key] = source
    rows = {key: s.shape[0] if s.shape else None for key, s in keys.items()}
    if None in rows.values() or len(set(rows.values())) != 1:
        raise InvalidTensor(f"--by rows needs tensors with the same first dimension; found {rows}")
    return keys


def _read_shapes(path: Path) -> Iterator[tuple[str, _Source]]:
    mtime = path.stat().st_mtime_ns
    if path.suffix == ".npy":
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        try:
            dtype = torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
        except TypeError as exc:
            raise InvalidTensor(f"{path}: numpy dtype {array.dtype} has no torch counterpart") from exc
        yield path.stem, _Source(path, None, dtype, tuple(array.shape), mtime)
        return
    if path.suffix != ".safetensors":
        raise InvalidTensor(f"{path}: --by rows reads .safetensors and .npy files, not {path.suffix!r}")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            part = f.get_slice(key)
            shape = tuple(int(n) for n in part.get_shape())
            dtype = part[0:0].dtype if shape else f.get_tensor(key).dtype
            yield key, _Source(path, key, dtype, shape, mtime)


def _split_rows(keys: dict[str, _Source], count: int, dataset: str, block_bytes: int) -> list[Shard]:
    total = next(iter(keys.values())).shape[0]
    shards = [Shard(k, dataset) for k in range(count)]
    for shard in shards:
        lo, hi = shard.index * total // count, (shard.index + 1) * total // count
        for key in sorted(keys):
            source = keys[key]
            step = max(1, block_bytes // max(source.row_bytes, 1))
            for start in range(lo, hi, step):
                stop = min(start + step, hi)
                name = f"{shard.prefix}rows/{key}/{start:012d}"
                nbytes = (stop - start) * source.row_bytes
                shard.items.append(Item(name, nbytes, source.path, key=key, tensor=source.tensor,
                                        start=start, stop=stop, mtime_ns=source.mtime_ns))  # fmt: skip
    return shards


# -- manifests -----------------------------------------------------------------------------------
def manifest(plan: Plan, shard: Shard, digests: dict[str, Expected], identity: str) -> bytes:
    """The shard's manifest: every item, with the dtype, shape and xxh3-64 verified on the node,
    and the identity of the plan it was written by (``plan_identity``)."""
    items: list[dict[str, Any]] = []
    for item in shard.items:
        dtype, shape, value = digests[item.name]
        entry: dict[str, Any] = {"name": item.name, "dtype": dtype_name(dtype), "shape": list(shape),
                                 "nbytes": item.nbytes, "xxh3": f"{value:016x}"}  # fmt: skip
        if item.path is not None:
            entry["path"] = item.path
        else:
            entry.update(key=item.key, start=item.start, stop=item.stop)
        items.append(entry)
    body = {"format": FORMAT, "dataset": plan.dataset, "shard": shard.index, "shards": len(plan.shards),
            "by": plan.by, "keys": plan.keys, "identity": identity, "items": items}  # fmt: skip
    return json.dumps(body, indent=1).encode()


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """The manifest stored under ``where``, every field checked: it comes from a server, and what
    readers do with it (name files, size buffers, count rows) must not depend on trusting it."""
    try:
        body: dict[str, Any] = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidTensor(f"{where}: not a data set manifest ({exc})") from exc
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise InvalidTensor(f"{where}: not a {FORMAT} manifest")
    by, keys, items = body.get("by"), body.get("keys"), body.get("items")
    if by not in ("files", "rows"):
        raise InvalidTensor(f"{where}: 'by' is {by!r}, not 'files' or 'rows'")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise InvalidTensor(f"{where}: 'keys' is not a list of strings")
    if not isinstance(items, list):
        raise InvalidTensor(f"{where}: 'items' is not a list")
    identity = body.get("identity")  # absent in manifests written before identities
    if identity is not None and not (isinstance(identity, str) and 0 < len(identity) <= IDENTITY_BYTES):
        raise InvalidTensor(f"{where}: 'identity' is not a digest")
    prefix = where.removesuffix("manifest")
    for i, item in enumerate(items):
        _check_item(item, by, set(keys), prefix, f"{where}: item {i}")
    return body


def _check_item(item: object, by: str, keys: set[str], prefix: str, where: str) -> None:
    if not isinstance(item, dict):
        raise InvalidTensor(f"{where} is not an object")
    name, shape, nbytes = item.get("name"), item.get("shape"), item.get("nbytes")
    if not isinstance(name, str) or not name.startswith(prefix):
        raise InvalidTensor(f"{where}: its name {name!r} is not under {prefix!r}")
    if not isinstance(shape, list) or not all(_count(n) for n in shape) or not _count(nbytes):
        raise InvalidTensor(f"{where}: its shape or size is not made of non-negative integers")
    if not isinstance(item.get("xxh3"), str) or not isinstance(item.get("dtype"), str):
        raise InvalidTensor(f"{where}: its xxh3 or dtype is not a string")
    if by == "files":
        if not isinstance(item.get("path"), str) or item["dtype"] != "uint8" or shape != [nbytes]:
            raise InvalidTensor(f"{where}: a file item needs a path and uint8 bytes")
    elif item.get("key") not in keys or not _count(item.get("start")) or not _count(item.get("stop")):
        raise InvalidTensor(f"{where}: a rows item needs a key of the data set and a start and stop row")
    elif item["start"] > item["stop"] or not shape or shape[0] != item["stop"] - item["start"]:
        raise InvalidTensor(f"{where}: its rows [{item['start']}, {item['stop']}) do not match its shape")


def _count(value: object) -> bool:
    """A JSON non-negative integer (bool is an int in Python, not in JSON)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
