"""``tensorwire put | get | ls | stat | rm``: tensors between files and a server.

A file is ``.safetensors``, ``.npy`` or ``.pt``/``.pth``; ``load_tensor`` reads the one tensor a
command sends (``put --generation``: every tensor of a safetensors checkpoint as one generation,
``tensorwire.hf``) and ``save_tensor`` writes one atomically, never through a link planted where
it goes.
Tensor names come from the server: escaped before they reach the terminal (``tensorwire.cli.text``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from tensorwire._fs import write_file
from tensorwire.cli.options import CliError, open_client, server_option
from tensorwire.cli.text import markup, printable
from tensorwire.hf.checkpoint import open_checkpoint
from tensorwire.types import MiB, TensorMeta
from tensorwire.wire.dtypes import dtype_name

PROGRESS_MIN_BYTES = 64 * MiB  # below this a transfer is over before a bar would be worth drawing
FORMATS = (".safetensors", ".npy", ".pt", ".pth")

# torch dtypes numpy has an exact counterpart for; others (bfloat16, float8, ...) cannot go to .npy.
_NUMPY_DTYPES = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
})  # fmt: skip


@click.command()
@click.argument("name")
@click.argument("file", type=click.Path(exists=True, path_type=Path))
@server_option
@click.option("--key", help="Which tensor of FILE to send, when it holds several.")
@click.option(
    "--generation", is_flag=True,
    help="Publish every tensor of FILE as one generation of the prefix NAME: a .safetensors file, a "
    "sharded checkpoint's model.safetensors.index.json, or a save_pretrained folder.",
)  # fmt: skip
def put(name: str, file: Path, server: str, key: str | None, generation: bool) -> None:
    """Store the tensor in FILE (.safetensors, .npy, .pt/.pth) under NAME; with --generation, every
    tensor of a safetensors checkpoint as one generation of NAME (NAME/<tensor name>)."""
    if generation:
        if key is not None:
            raise CliError("--key picks one tensor; --generation publishes them all")
        _put_generation(name, file, server)
        return
    if file.is_dir():
        raise CliError(f"{file} is a directory: publish a checkpoint folder with --generation")
    tensor = load_tensor(file, key)
    nbytes = tensor.numel() * tensor.element_size()
    with open_client(server) as client, _progress(nbytes, f"put {name}") as advance:
        start = time.perf_counter()
        version = client.put(name, tensor, progress=advance)
        elapsed = time.perf_counter() - start
    click.echo(f"{name}  version {version}  {nbytes} bytes  {_rate(nbytes, elapsed)}")


def _put_generation(prefix: str, path: Path, server: str) -> None:
    """``put --generation``: the checkpoint at ``path`` (memory-mapped) as one generation."""
    with open_checkpoint(path) as tensors:  # a refusal (InvalidTensor) names the file
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with open_client(server) as client, _progress(nbytes, f"put {prefix}") as advance:
            start = time.perf_counter()
            gen = client.publish(prefix, tensors, progress=advance)
            elapsed = time.perf_counter() - start
    sent = f"{len(gen.names)} tensors  {gen.nbytes} bytes  {_rate(nbytes, elapsed)}"
    click.echo(f"{prefix}  generation {gen.number}  {sent}")


@click.command()
@click.argument("name")
@click.option(
    "-o", "--output", "output", required=True, type=click.Path(dir_okay=False, path_type=Path),
    help="File to write: .safetensors, .npy, .pt or .pth.",
)  # fmt: skip
@server_option
@click.option("--key", help="Tensor key inside a .safetensors output (default: NAME).")
def get(name: str, output: Path, server: str, key: str | None) -> None:
    """Fetch NAME into a file."""
    fmt = _format_of(output)
    if not output.parent.is_dir():  # fail before the transfer, not after it
        raise CliError(f"cannot write {output}: directory {output.parent} does not exist")
    with open_client(server) as client:
        meta = client.stat(name)  # the size for the bar, and a dtype check before any bytes move
        _check_writable(meta, fmt)
        with _progress(meta.nbytes, f"get {name}") as advance:
            start = time.perf_counter()
            tensor = client.get(name, progress=advance)
            elapsed = time.perf_counter() - start
    save_tensor(tensor, output, key or name)
    nbytes = tensor.numel() * tensor.element_size()
    click.echo(f"{name}  -> {output}  {nbytes} bytes  {_rate(nbytes, elapsed)}")


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s"


@contextlib.contextmanager
def _progress(total: int, what: str) -> Iterator[Callable[[int], None] | None]:
    """A rich bar on stderr for big transfers; yields the client's progress callback (or None)."""
    if total <= PROGRESS_MIN_BYTES:
        yield None
        return
    console = Console(stderr=True)
    # markup=False: the description holds a tensor name, which is not rich markup.
    columns = (TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
               TransferSpeedColumn())  # fmt: skip
    # Drawn only on a terminal: in a log or a pipe a bar is just noise.
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(printable(what, 200), total=total)
        # Called on the client's event loop thread; Progress.advance takes its own lock.
        yield lambda n: bar.advance(task, n)


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise CliError(f"{path}: unsupported file type {suffix or '(none)'!r}; use {', '.join(FORMATS)}")
    return ".pt" if suffix == ".pth" else suffix


def load_tensor(path: Path, key: str | None) -> torch.Tensor:
    """The tensor in ``path``: the file's only tensor, or the one under ``key``."""
    fmt = _format_of(path)
    if fmt == ".safetensors":
        return _load_safetensors(path, key)
    try:  # a boundary with arbitrary user files: any failure to parse is the file's fault
        loaded: object = (
            _load_npy(path) if fmt == ".npy" else torch.load(path, map_location="cpu", weights_only=True)
        )
    except (CliError, OSError):
        raise
    except Exception as exc:
        raise CliError(f"cannot read {path}: {exc}") from exc
    return _pick(loaded, key, path)


def _load_npy(path: Path) -> torch.Tensor:
    import numpy as np

    array = np.load(path, allow_pickle=False)
    if not isinstance(array, np.ndarray):
        raise CliError(f"{path} is not a single .npy array")
    if not array.dtype.isnative:  # torch only wraps native byte order
        array = array.astype(array.dtype.newbyteorder("="))
    return torch.from_numpy(array)


def _load_safetensors(path: Path, key: str | None) -> torch.Tensor:
    from safetensors import safe_open

    try:  # safe_open reads only the header and the one tensor asked for, not the whole file
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
            chosen = _choose_key(keys, key, path)
            tensor: torch.Tensor = f.get_tensor(chosen)
            return tensor
    except CliError:
        raise
    except Exception as exc:
        raise CliError(f"cannot read {path}: {exc}") from exc


def _pick(loaded: object, key: str | None, path: Path) -> torch.Tensor:
    if isinstance(loaded, torch.Tensor):
        if key is not None:
            raise CliError(f"--key {key!r} given, but {path} holds a single tensor")
        return loaded
    if isinstance(loaded, Mapping):
        chosen = _choose_key([str(k) for k in loaded], key, path)
        value = loaded[chosen]
        if isinstance(value, torch.Tensor):
            return value
        raise CliError(f"{path}: {chosen!r} is not a tensor but a {type(value).__name__}")
    raise CliError(f"{path} holds a {type(loaded).__name__}: expected a tensor or a dict of tensors")


def _choose_key(keys: list[str], key: str | None, path: Path) -> str:
    shown = ", ".join(keys[:20]) + (f", ... ({len(keys)} in all)" if len(keys) > 20 else "")
    if key is None:
        if len(keys) == 1:
            return keys[0]
        raise CliError(
            f"{path} holds {len(keys)} tensors; pick one with --key ({shown or 'none'}), or publish them"
            " all as one generation with --generation"
        )
    if key not in keys:
        raise CliError(f"no key {key!r} in {path}; it holds: {shown or 'nothing'}")
    return key


def _check_writable(meta: TensorMeta, fmt: str) -> None:
    if fmt == ".npy" and meta.dtype not in _NUMPY_DTYPES:
        raise CliError(
            f"{meta.name!r} is {dtype_name(meta.dtype)}, which numpy has no dtype for; "
            "write .safetensors or .pt instead"
        )


def save_tensor(tensor: torch.Tensor, path: Path, key: str) -> None:
    """Write ``tensor`` to ``path`` in the format its suffix names, atomically: into a fresh
    temporary file (never one planted under a guessable name), then renamed over ``path``."""
    fmt = _format_of(path)
    if fmt == ".npy":
        import numpy as np

        write_file(path, lambda f: np.save(f, tensor.numpy(), allow_pickle=False))
    elif fmt == ".pt":
        write_file(path, lambda f: torch.save(tensor, f))
    else:
        data = _safetensors_bytes(tensor, path, key)
        write_file(path, lambda f: f.write(data))


def _safetensors_bytes(tensor: torch.Tensor, path: Path, key: str) -> bytes:
    import safetensors.torch

    try:
        data: bytes = safetensors.torch.save({key: tensor.contiguous()})
    except Exception as exc:  # e.g. a dtype the safetensors format has no code for
        raise CliError(f"cannot write {path.suffix}: {exc}") from exc
    return data


# -- ls / stat / rm --------------------------------------------------------------------------------
def meta_dict(meta: TensorMeta) -> dict[str, Any]:
    """The JSON form of a tensor's metadata (``ls --json``, ``stat --json``)."""
    return {
        "name": meta.name,
        "dtype": dtype_name(meta.dtype),
        "shape": list(meta.shape),
        "nbytes": meta.nbytes,
        "version": meta.version,
    }


@click.command("ls")
@click.argument("prefix", default="")
@server_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
def ls(prefix: str, server: str, as_json: bool) -> None:
    """List stored tensors (whose names start with PREFIX)."""
    with open_client(server) as client:
        metas = client.list(prefix)
    if as_json:
        click.echo(json.dumps([meta_dict(m) for m in metas], indent=2))
        return
    table = Table("name", "dtype", "shape", "bytes", "version")
    for meta in metas:  # names come from the server: escaped, never markup or escape sequences
        table.add_row(markup(meta.name), dtype_name(meta.dtype), _shape(meta), f"{meta.nbytes:,}",
                      str(meta.version))  # fmt: skip
    Console().print(table)


def _shape(meta: TensorMeta) -> str:
    return "[" + ", ".join(str(d) for d in meta.shape) + "]"


@click.command()
@click.argument("name")
@server_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def stat(name: str, server: str, as_json: bool) -> None:
    """Show the metadata of NAME."""
    with open_client(server) as client:
        meta = client.stat(name)
    if as_json:
        click.echo(json.dumps(meta_dict(meta), indent=2))
        return
    for field, value in meta_dict(meta).items():
        click.echo(f"{field:8} {printable(value)}")


@click.command()
@click.argument("name")
@server_option
def rm(name: str, server: str) -> None:
    """Remove NAME."""
    with open_client(server) as client:
        client.delete(name)
    click.echo(f"removed {name}")
