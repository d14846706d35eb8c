"""Asynchronous checkpoints of sharded state: ``async_save`` and the ``AsyncSaver`` behind it.

A save copies every local shard of a state dict into host buffers (``Snapshot``) and returns;
the upload (``put_state_dict``, a collective) runs on the saver's own thread while training goes
on, and a ``concurrent.futures.Future`` says when the generation is committed on the server.

Lifecycle of an ``AsyncSaver`` (one per training process, made and used alike on every rank):

1. ``AsyncSaver(group=None)``: where torch.distributed is initialized, a collective over the whole
   default group (``dist.new_group`` requires every process of it), run synchronously: it makes a
   gloo group of ``group``'s ranks that only this saver's uploads use. Background collectives on
   the training's own group could interleave with the training's (a gloo or NCCL group matches
   collectives by order, not by thread), so they never share one; this is what
   ``torch.distributed.checkpoint.async_save`` does too.
2. ``save(client_or_url, prefix, state_dict) -> Future[Generation]``, called by every rank of
   ``group`` in the same order: first it **waits** for this saver's previous save to finish (at
   most one in flight: its buffers are the ones the next snapshot reuses, and the group's
   collectives must not overlap), then copies the local shards (``DTensor.to_local()``, or the
   tensor itself when it is not a DTensor) into the snapshot's buffers, hands the upload to the
   saver's thread and returns. CUDA tensors are copied into pinned buffers with ``non_blocking``
   on the current stream (so later kernels on it that change the parameters run after the copy)
   and the upload first waits on an event recorded after the copies. The future holds the
   committed ``Generation``, or the error that stopped the upload: nothing is raised on the
   thread, and a failed save does not stop the next one. ``blocked_s`` is how long the last
   ``save`` kept its caller.
3. ``close()`` (or leaving ``with``): waits for the last save, closes the clients the saver opened
   from URLs and destroys its group. A saver is not reopened.

``client_or_url``: a ``Client`` is used from the saver's thread as it is (a ``Client`` may be
called from any thread: each call runs on the client's own event loop); for a URL the saver
opens a client of its own, on first use, and keeps it until ``close``.

``async_save(client_or_url, prefix, state_dict, group=None)`` is the one-call entry point: it saves
through the process's default saver of ``group`` (made on the first call, so that first call is
the collective of step 1 on every process of the default group), or through ``saver=``.

FSDP: ``training_state(model, optimizer)`` gives the flat name -> tensor dict of a model's and an
optimizer's state (``torch.distributed.checkpoint.state_dict.get_state_dict``: DTensors under
``fully_shard``) to save, and to load into on resume (``load_state_dict`` fills it in place), and
``load_training_state`` hands it back to them (``set_state_dict``).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict as torch_state
from torch.distributed.tensor import DTensor

from tensorwire._deprecated import renamed
from tensorwire.client import Client, connect
from tensorwire.errors import TransferTimeout
from tensorwire.sharded import state
from tensorwire.types import Generation

DEFAULT_TIMEOUT = 60.0  # seconds for one upload (``put_state_dict``'s timeout)
ClientOrUrl = Client | str
ProcessGroup = dist.ProcessGroup


# -- the snapshot ----------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """Host copies of a state dict's local shards, reused from save to save: one buffer per name,
    made again only when that name's shape or dtype changes; pinned when its source is on CUDA.

    ``take`` starts the copies and returns the state dict to upload (each DTensor's local tensor
    replaced by its buffer, the global shape and placements kept); ``wait_copied`` returns once
    they are done (at once for CPU sources, whose copies are synchronous)."""

    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    _copied: Any = None  # a torch.cuda.Event recorded after the last take's device copies

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def take(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        copies = {name: self._copy(name, tensor) for name, tensor in state_dict.items()}
        on_cuda = any(_local(t).is_cuda for t in state_dict.values())
        self._copied = _record_event() if on_cuda else None
        return copies

    def wait_copied(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def _copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        local = _local(tensor)
        buffer = self._buffer(name, local)
        with torch.no_grad():
            buffer.copy_(local, non_blocking=local.is_cuda)
        return _rewrap(tensor, buffer) if isinstance(tensor, DTensor) else buffer

    def _buffer(self, name: str, local: torch.Tensor) -> torch.Tensor:
        held = self.buffers.get(name)
        pin = local.is_cuda
        if held is None or held.shape != local.shape or held.dtype != local.dtype or held.is_pinned() != pin:
            held = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
            self.buffers[name] = held
        return held


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _rewrap(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor of ``like``'s global shape, mesh and placements whose local tensor is ``local``.
    ``DTensor.from_local`` would move a host copy back to a CUDA mesh's device, so for those the
    spec is reused as it is (the private constructor ``from_local`` itself ends in)."""
    if like.device_mesh.device_type == local.device.type:
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())  # fmt: skip
    return DTensor(local, like._spec, requires_grad=False)  # type: ignore[no-untyped-call]


def _record_event() -> Any:
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


# -- the saver -------------------------------------------------------------------------------------
class AsyncSaver:
    """Snapshots and background uploads of sharded state (the module docstring has its lifecycle).

    At most one save is in flight per saver: ``save`` waits (at most ``timeout`` seconds, then
    ``TransferTimeout``) for the previous one before it snapshots."""

    def __init__(self, group: ProcessGroup | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.timeout = timeout
        self.snapshot = Snapshot()
        self.blocked_s = 0.0  # how long the last save() kept its caller (waiting + copying)
        self.saves = 0
        self._group = _upload_group(group)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tensorwire-save")
        self._last: concurrent.futures.Future[Generation] | None = None
        self._clients: dict[str, Client] = {}  # opened from URLs, on the saver's thread
        self._closed = False

    def save(
        self, client_or_url: ClientOrUrl, prefix: str, state_dict: Mapping[str, torch.Tensor]
    ) -> concurrent.futures.Future[Generation]:
        """Snapshot ``state_dict``'s local shards now; upload them as a generation of ``prefix`` in
        the background. Every rank of the group calls it, in the same order."""
        if self._closed:
            raise RuntimeError("this AsyncSaver is closed")
        started = time.perf_counter()
        self._wait_previous()
        copies = self.snapshot.take(state_dict)
        future = self._thread.submit(self._upload, client_or_url, prefix, copies)
        self._last = future
        self.saves += 1
        self.blocked_s = time.perf_counter() - started
        return future

    def wait(self) -> Generation | None:
        """The last save's generation (None before any); raises its error if it failed."""
        self._wait_previous()
        return None if self._last is None else self._last.result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # its error belongs to its future's owner
            self._wait_previous()
        self._thread.shutdown(wait=True)
        for client in self._clients.values():
            client.close()
        if self._group is not None and dist.is_initialized():
            # Already gone if its job's default group was destroyed (and maybe made again) first.
            with contextlib.suppress(RuntimeError, ValueError):
                dist.destroy_process_group(self._group)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> AsyncSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_previous(self) -> None:
        last = self._last
        if last is None:
            return
        done, _ = concurrent.futures.wait([last], timeout=self.timeout)
        if not done:
            raise TransferTimeout(f"waited {self.timeout:.3g}s for the previous save to finish")

    def _upload(self, client_or_url: ClientOrUrl, prefix: str, copies: dict[str, torch.Tensor]) -> Generation:
        self.snapshot.wait_copied()
        client = self._client(client_or_url)
        return state.put_state_dict(client, prefix, copies, group=self._group, timeout=self.timeout)

    def _client(self, client_or_url: ClientOrUrl) -> Client:
        if not isinstance(client_or_url, str):
            return client_or_url
        if client_or_url not in self._clients:
            self._clients[client_or_url] = connect(client_or_url, timeout=self.timeout)
        return self._clients[client_or_url]


def _upload_group(group: ProcessGroup | None) -> ProcessGroup | None:
    """A gloo group of ``group``'s ranks for the uploads alone (None without torch.distributed: a
    world of one). Collective over the default group, as ``dist.new_group`` is."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    ranks = None if group is None else dist.get_process_group_ranks(group)
    made: ProcessGroup = dist.new_group(ranks=ranks, backend="gloo")
    return made


# -- the one-call entry point ----------------------------------------------------------------------
# One saver per (group, default group) pair, made on first use: a default group destroyed and made
# again (a new job in the same process) gets savers of its own.
_DEFAULTS: list[tuple[tuple[object, object], AsyncSaver]] = []
_DEFAULTS_LOCK = threading.Lock()


def default_saver(group: ProcessGroup | None = None) -> AsyncSaver:
    """The process's saver for ``group``, made on the first call (a collective: see AsyncSaver)."""
    key = (group, dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
    with _DEFAULTS_LOCK:
        for held, saver in _DEFAULTS:
            if held[0] is key[0] and held[1] is key[1] and not saver.closed:
                return saver
        saver = AsyncSaver(group)
        _DEFAULTS.append((key, saver))
        return saver


def async_save(
    client_or_url: ClientOrUrl,
    prefix: str,
    state_dict: Mapping[str, torch.Tensor],
    *,
    group: ProcessGroup | None = None,
    saver: AsyncSaver | None = None,
) -> concurrent.futures.Future[Generation]:
    """Snapshot ``state_dict``'s local shards and return; upload them in the background as a
    generation of ``prefix``, committed on the server once every rank's part is in (the future's
    result, on every rank). A collective over ``group``: every rank calls it, in the same order.
    A save waits for the previous one of the same saver to finish before it snapshots. Named in
    ``torch.distributed.checkpoint.async_save``'s word order."""
    return (saver or default_saver(group)).save(client_or_url, prefix, state_dict)


# The name before issue 33, kept for one release (it warns).
save_async = renamed("tensorwire.sharded.save_async", async_save)


@atexit.register
def _close_defaults() -> None:
    with _DEFAULTS_LOCK:
        savers = [saver for _, saver in _DEFAULTS]
        _DEFAULTS.clear()
    for saver in savers:
        saver.close()


# -- FSDP: a model's and an optimizer's state as one flat dict --------------------------------------
MODEL = "model"
OPTIM = "optim"


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The model's and the optimizer's tensors as one flat dict: ``model/<fqn>`` and
    ``optim/<fqn>/<key>`` (``exp_avg``, ``step``, ...), DTensors where ``fully_shard`` made them.
    The tensors are the ones torch's ``get_state_dict`` returns, so a load into them followed by
    ``load_training_state`` restores both. The optimizer's hyperparameters (``param_groups``) are
    not in it: a resuming job builds its optimizer with the same ones. A fresh optimizer's state
    is made (torch steps it with zero gradients and lr 0) so that there is something to load into."""
    model_state, optim_state = torch_state.get_state_dict(model, optimizer)
    flat = {f"{MODEL}/{fqn}": t for fqn, t in model_state.items() if isinstance(t, torch.Tensor)}
    per_param: dict[str, Any] = dict(optim_state["state"])  # type: ignore[arg-type]
    for fqn, entries in per_param.items():
        flat |= {f"{OPTIM}/{fqn}/{key}": t for key, t in entries.items() if isinstance(t, torch.Tensor)}
    return flat


def load_training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, flat: Mapping[str, torch.Tensor]
) -> None:
    """Hand ``flat`` (``training_state``'s names) back to ``model`` and ``optimizer``."""
    _, current = torch_state.get_state_dict(model, optimizer)  # param_groups (hyperparameters) as built
    model_state: dict[str, Any] = {
        name.split("/", 1)[1]: t for name, t in flat.items() if name.startswith(f"{MODEL}/")
    }
    state: dict[str, Any] = {}
    for name, tensor in flat.items():
        if name.startswith(f"{OPTIM}/"):
            fqn, key = name.split("/", 1)[1].rsplit("/", 1)
            state.setdefault(fqn, {})[key] = tensor
    optim_state: dict[str, Any] = {"state": state, "param_groups": current["param_groups"]}
    torch_state.set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


__all__ = [
    "DEFAULT_TIMEOUT",
    "AsyncSaver",
    "Snapshot",
    "async_save",
    "default_saver",
    "load_training_state",
    "save_async",
    "training_state",
]
