"""What a generation of weights must look like to be applied to a model, checked before a byte of it
is read (the engine's side of ``tensorwire.vllm``).

The reference is the checkpoint the engine was started from: its safetensors headers name every
tensor ``load_weights`` takes, in the checkpoint's own names (``q_proj``, not vLLM's fused
``qkv_proj``), with their shapes and dtypes. A generation is accepted when it holds exactly those
names with those shapes, each in the checkpoint's dtype or the model's own (a trainer may send
bfloat16 weights to a bfloat16 engine started from a float32 checkpoint). So the bytes a generation
may make an engine hold are bounded by the model itself: the check runs on the manifest, before the
staging tensors are allocated or a chunk is read. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorwire.errors import LayoutMismatch
from tensorwire.types import GenerationManifest, TensorMeta

# The key a trainer's version string is published under, beside the weights: "@" is in no
# PyTorch parameter name, so it cannot collide with one (and `load_weights` never sees it).
VERSION_KEY = "@version"
MAX_VERSION_BYTES = 256
# A safetensors header is JSON of a few hundred bytes per tensor: 64 MiB covers models with
# hundreds of thousands of tensors, and bounds what a planted file can make the engine read.
MAX_HEADER_BYTES = 64 << 20

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass(frozen=True)
class Expected:
    """One tensor ``load_weights`` takes: its shape and the dtypes it may come in."""

    shape: tuple[int, ...]
    dtypes: frozenset[torch.dtype]

    @property
    def most_bytes(self) -> int:
        return math.prod(self.shape) * max(d.itemsize for d in self.dtypes)


@dataclass(frozen=True)
class Reference:
    """The tensors a model takes, by checkpoint name (``expected``), and where that came from."""

    expected: Mapping[str, Expected]
    source: str

    @property
    def most_bytes(self) -> int:
        """The most bytes a generation that fits may hold, what staging one may cost."""
        return sum(e.most_bytes for e in self.expected.values()) + MAX_VERSION_BYTES

    def check(self, manifest: GenerationManifest, prefix: str) -> list[TensorMeta]:
        """The generation's weights (its version record left out), in name order; LayoutMismatch
        naming the first difference if they are not exactly the reference's tensors. Run on the
        manifest, so nothing is read or allocated for a generation that does not fit."""
        number = manifest.generation.number
        if manifest.generation.nbytes > self.most_bytes:
            raise LayoutMismatch(
                f"generation {number} of {prefix!r} holds {manifest.generation.nbytes} bytes, more than "
                f"the {self.most_bytes} the model's weights take ({self.source}): refused before reading it"
            )
        metas = [entry.meta for entry in manifest.tensors]
        weights = [m for m in metas if key_of(prefix, m.name) != VERSION_KEY]
        for meta in weights:
            self._check_one(key_of(prefix, meta.name), meta, number)
        held = {key_of(prefix, m.name) for m in weights}
        missing = sorted(set(self.expected) - held)
        if missing:
            raise LayoutMismatch(
                f"generation {number} of {prefix!r} lacks {missing[0]!r} (and {len(missing) - 1} more), "
                f"which the model takes ({self.source})"
            )
        for meta in metas:
            if key_of(prefix, meta.name) == VERSION_KEY and (
                meta.dtype != torch.uint8 or meta.shape != (MAX_VERSION_BYTES,)
            ):
                raise LayoutMismatch(
                    f"generation {number} of {prefix!r}: its version record is {meta.dtype} "
                    f"{list(meta.shape)}, not a uint8 string padded to {MAX_VERSION_BYTES} bytes"
                )
        return weights

    def _check_one(self, key: str, meta: TensorMeta, number: int) -> None:
        expected = self.expected.get(key)
        if expected is None:
            raise LayoutMismatch(
                f"generation {number} has {key!r}, which the model does not take ({self.source})"
            )
        if meta.shape != expected.shape:
            raise LayoutMismatch(
                f"generation {number}: {key!r} is {list(meta.shape)}, the model takes {list(expected.shape)} "
                f"({self.source})"
            )
        if meta.dtype not in expected.dtypes:
            allowed = " or ".join(sorted(str(d) for d in expected.dtypes))
            raise LayoutMismatch(f"generation {number}: {key!r} is {meta.dtype}, the model takes {allowed}")


def decode_version(record: torch.Tensor, number: int) -> str:
    """The version string a record holds (publisher.version_record), or the generation's number
    when it holds none."""
    raw = bytes(record.numpy()).rstrip(b"\0")
    return raw.decode("utf-8", "replace") if raw else str(number)


def key_of(prefix: str, name: str) -> str:
    """A published name's key: ``name`` without ``prefix/``."""
    return name[len(prefix) + 1 :] if name.startswith(prefix + "/") else name


def from_checkpoint(folder: Path, model_dtype: torch.dtype | None = None) -> Reference:
    """The reference of the safetensors checkpoint in ``folder`` (every ``*.safetensors`` file's
    header, read without its data); LayoutMismatch if it has none. ``model_dtype``: the dtype the
    engine runs the model in, also accepted for each floating-point tensor."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LayoutMismatch(
            f"no *.safetensors checkpoint in {str(folder)!r}: tensorwire.vllm checks each generation "
            "against the checkpoint the engine was started from"
        )
    expected: dict[str, Expected] = {}
    for file in files:
        for name, (dtype, shape) in read_header(file).items():
            dtypes = {dtype}
            if model_dtype is not None and dtype.is_floating_point:
                dtypes.add(model_dtype)
            expected[name] = Expected(shape, frozenset(dtypes))
    return Reference(expected, f"the checkpoint in {folder}")


def from_tensors(tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> Reference:
    """A reference of named tensors (a model's checkpoint-format state dict, in a test or a tool)."""
    return Reference({k: Expected(tuple(t.shape), frozenset({t.dtype})) for k, t in tensors}, source)


def read_header(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors a safetensors file declares (its 8-byte length, then JSON), data not read."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise LayoutMismatch(f"{path}: not a safetensors file (no header length)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise LayoutMismatch(f"{path}: a header of {length} bytes, over {MAX_HEADER_BYTES}")
        raw = f.read(length)
    if len(raw) != length:
        raise LayoutMismatch(f"{path}: its header is cut short ({len(raw)} of {length} bytes)")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise LayoutMismatch(f"{path}: its safetensors header is not JSON") from exc
    if not isinstance(doc, dict):
        raise LayoutMismatch(f"{path}: its safetensors header is not a JSON object")
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype", "")) if isinstance(entry, dict) else None
        if dtype is None:
            raise LayoutMismatch(f"{path}: {name!r} has a dtype tensorwire.vllm does not know")
        out[name] = (dtype, _shape(path, name, entry.get("shape")))
    return out


def _shape(path: Path, name: str, shape: object) -> tuple[int, ...]:
    """A header's shape: a list of non-negative integers (not a string of digits, a float or a
    bool, which ``int()`` would quietly turn into another shape)."""
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise LayoutMismatch(f"{path}: {name!r} has the shape {repr(shape)[:80]}, not a list of sizes")
    return tuple(shape)
