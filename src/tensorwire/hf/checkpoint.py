"""A safetensors checkpoint as ``from_pretrained`` finds it: ``model.safetensors``, or the shards a
``model.safetensors.index.json`` names, each memory-mapped (safetensors' ``safe_open``: a tensor's
pages are read when it is sent, not before).

A checkpoint is someone else's file. The index is JSON whose ``weight_map`` maps each tensor name
to the shard holding it: every shard must be a plain file name in the index's own folder (no
``..``, no separator, not absolute), a name may appear once, and every shard must hold exactly the
names the index gives it. Each shard's header (names, dtypes, shapes, byte offsets) is checked by
safetensors itself as it opens: sizes that disagree with shapes, or offsets past the file, refuse
the file. Every refusal is an ``InvalidTensor`` naming the file.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from tensorwire.errors import InvalidTensor
from tensorwire.types import MiB

SAFE_WEIGHTS_NAME = "model.safetensors"  # transformers' names for them (utils.SAFE_WEIGHTS_*)
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 * MiB  # an index of 10^6 tensors is ~60 MiB; a larger one is not an index


def shards(path: Path) -> dict[Path, list[str] | None]:
    """The files of the checkpoint at ``path`` (a folder, an index, or one ``.safetensors`` file),
    each with the names the index gives it (None: whatever the single file holds). A folder is read
    as ``from_pretrained`` reads one: ``model.safetensors`` if present, else the index."""
    if path.is_dir():
        if (path / SAFE_WEIGHTS_NAME).is_file():
            return {path / SAFE_WEIGHTS_NAME: None}
        if not (path / SAFE_WEIGHTS_INDEX_NAME).is_file():
            raise InvalidTensor(f"{path}: neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}")
        path = path / SAFE_WEIGHTS_INDEX_NAME
    if path.suffix == ".json":
        return _index(path)
    if path.suffix != ".safetensors":
        raise InvalidTensor(f"{path}: a checkpoint is a .safetensors file, its index (.json) or their folder")
    return {path: None}


def _index(path: Path) -> dict[Path, list[str] | None]:
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_INDEX_BYTES + 1)
        if len(raw) > MAX_INDEX_BYTES:
            raise InvalidTensor(f"{path}: an index over {MAX_INDEX_BYTES} bytes")
        index = json.loads(raw, object_pairs_hook=_no_repeats)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidTensor(f"{path}: not a readable checkpoint index: {exc}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InvalidTensor(f"{path}: no weight_map (tensor name -> shard file) in the index")
    files: dict[Path, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not _plain_file_name(shard):
            raise InvalidTensor(f"{path}: tensor {name!r} lies in {shard!r}, not a file of its folder")
        files.setdefault(path.parent / shard, []).append(name)
    return dict(files.items())


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json keeps the last of two silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = [k for k, _ in pairs]
        raise InvalidTensor(f"the index names {next(k for k in seen if seen.count(k) > 1)!r} twice")
    return out


def _plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\\0") and ":" not in name


@contextlib.contextmanager
def open_checkpoint(path: Path | str) -> Iterator[dict[str, torch.Tensor]]:
    """Every tensor of the checkpoint at ``path``, by name, memory-mapped while the context lasts."""
    with contextlib.ExitStack() as stack:
        tensors: dict[str, torch.Tensor] = {}
        for file, names in shards(Path(path)).items():
            handle = _open(stack, file)
            held = list(handle.keys())
            if names is not None and sorted(held) != sorted(names):
                extra, missing = sorted(set(held) - set(names)), sorted(set(names) - set(held))
                raise InvalidTensor(
                    f"{file}: the index and the shard disagree (in the shard only: {extra[:5]}; "
                    f"in the index only: {missing[:5]})"
                )
            for name in held:
                if name in tensors:
                    raise InvalidTensor(f"{file}: {name!r} is in two shards")
                tensors[name] = _tensor(handle, file, name)
        if not tensors:
            raise InvalidTensor(f"{path}: the checkpoint holds no tensor")
        yield tensors


def _open(stack: contextlib.ExitStack, file: Path) -> Any:
    from safetensors import safe_open

    try:  # safetensors checks the header (sizes, offsets, dtypes) as it opens the file
        return stack.enter_context(safe_open(str(file), framework="pt"))
    except Exception as exc:  # a boundary with arbitrary files: SafetensorError, OSError, ...
        raise InvalidTensor(f"{file}: not a readable safetensors file: {exc}") from exc


def _tensor(handle: Any, file: Path, name: str) -> torch.Tensor:
    try:
        tensor: torch.Tensor = handle.get_tensor(name)
    except Exception as exc:  # e.g. a dtype this torch has no counterpart for
        raise InvalidTensor(f"{file}: cannot read {name!r}: {exc}") from exc
    return tensor
