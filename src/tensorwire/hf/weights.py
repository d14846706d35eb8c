"""A transformers model's weights to and from generations of a prefix, by the names
``save_pretrained`` writes (``names.py``).

``load_into`` plans before it reads: it takes the generation's manifest (names, dtypes, shapes),
maps every name onto a tensor the model saves (parameters and persistent buffers, each tied
weight once) and refuses, naming it, a name the model lacks or holds tied under another name, a
tensor the generation lacks, a shape or a dtype that differs, all before a byte of the model
changes. Then it reads that one generation (by its number, so a newer one published meanwhile is
not mixed in) straight into the model's CPU tensors (``get_many(out=...)``); a tensor on a device
is read into host memory and copied over. A read that fails midway (the server gone) can leave
some tensors of the new generation and some of the old: call ``load_into`` again.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from tensorwire.client.core import Client, connect
from tensorwire.client.generations import At
from tensorwire.errors import LayoutMismatch
from tensorwire.hf.checkpoint import open_checkpoint
from tensorwire.hf.names import SavedNames, saved_names
from tensorwire.security import TlsFiles
from tensorwire.types import Generation, GenerationManifest

DEFAULT_TIMEOUT = 120.0  # one request: a generation of a large model is one publish, one read


def publish(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    url: str,
    prefix: str,
    *,
    token: str | None = None,
    tls: TlsFiles | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Generation:
    """The weights of a model (or a state dict) as the next generation of ``prefix``, under the
    names ``save_pretrained`` writes: a tied weight is sent once. All visible at once, or none."""
    tensors = saved_names(model_or_state_dict).tensors
    with _connect(url, token, tls, timeout) as client:
        return client.publish(prefix, tensors)


def publish_checkpoint(
    folder: str | Path,
    url: str,
    prefix: str,
    *,
    token: str | None = None,
    tls: TlsFiles | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Generation:
    """A safetensors checkpoint (a ``save_pretrained`` folder: ``model.safetensors`` or the shards
    of ``model.safetensors.index.json``; or that index, or one ``.safetensors`` file) as the next
    generation of ``prefix``, each shard memory-mapped, never whole in memory."""
    with open_checkpoint(folder) as tensors, _connect(url, token, tls, timeout) as client:
        return client.publish(prefix, tensors)


def load_into(
    model: nn.Module,
    url: str,
    prefix: str,
    *,
    at: At = "latest",
    token: str | None = None,
    tls: TlsFiles | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> int:
    """Generation ``at`` of ``prefix`` into ``model``'s own tensors, in place (tied weights stay
    tied: filled once). LayoutMismatch, before anything is written, unless the generation holds
    exactly the tensors the model saves, with their shapes and dtypes. Returns the generation's
    number."""
    saved = saved_names(model, keep_vars=True)
    with _connect(url, token, tls, timeout) as client:
        number = plan(client.manifest(prefix, at), prefix, at, saved, model)
        targets = {f"{prefix}/{name}": tensor.detach() for name, tensor in saved.tensors.items()}
        outs = {full: t for full, t in targets.items() if t.is_cpu}
        read = client.get_many(list(targets), out=outs, at=number)
    staged = {full: read[full] for full, t in targets.items() if not t.is_cpu}
    for full, tensor in staged.items():  # every answer checked before the first copy
        _check(full, tensor.dtype, tuple(tensor.shape), targets[full], "read")
    with torch.no_grad():
        for full, tensor in staged.items():
            targets[full].copy_(tensor)
    return number


def plan(manifest: GenerationManifest, prefix: str, at: At, saved: SavedNames, model: nn.Module) -> int:
    """The number of the generation ``manifest`` describes, once every tensor of it is found to
    fit the model; LayoutMismatch naming the first that does not."""
    gen = manifest.generation
    if gen.prefix != prefix or gen.number < 1 or at not in ("latest", gen.number):
        raise LayoutMismatch(f"asked for generation {at} of {prefix!r}, got {gen.number} of {gen.prefix!r}")
    keys: set[str] = set()
    for entry in manifest.tensors:
        meta = entry.meta
        key = meta.name.removeprefix(f"{prefix}/")
        if key == meta.name or key in keys:
            raise LayoutMismatch(f"generation {gen.number} of {prefix!r} lists {meta.name!r} twice or apart")
        keys.add(key)
        _check(meta.name, meta.dtype, meta.shape, _target(key, saved, model, gen), "stored")
    missing = sorted(set(saved.tensors) - keys)
    if missing:
        raise LayoutMismatch(
            f"generation {gen.number} of {prefix!r} lacks {len(missing)} tensor(s) the model saves: "
            f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}"
        )
    return gen.number


def _target(key: str, saved: SavedNames, model: nn.Module, gen: Generation) -> torch.Tensor:
    where = f"generation {gen.number} of {gen.prefix!r} holds {key!r}"
    if key in saved.tied:
        raise LayoutMismatch(f"{where}, which this model ties to {saved.tied[key]!r}: sent once, as that")
    target = saved.tensors.get(key)
    if target is None:
        buffers = dict(model.named_buffers())
        what = "a buffer the model does not save" if key in buffers else "no tensor of this model"
        raise LayoutMismatch(f"{where}: {what}")
    if target.device.type == "meta":
        raise LayoutMismatch(f"{where}: the model's is on the meta device (materialize the model first)")
    return target


def _check(name: str, dtype: torch.dtype, shape: tuple[int, ...], target: torch.Tensor, what: str) -> None:
    if dtype != target.dtype or shape != tuple(target.shape):
        raise LayoutMismatch(
            f"{name!r}: {what} as {dtype}{list(shape)}, the model's is {target.dtype}{list(target.shape)}"
        )


def _connect(url: str, token: str | None, tls: TlsFiles | None, timeout: float) -> Client:
    return connect(url, token=token, tls=tls, timeout=timeout)
