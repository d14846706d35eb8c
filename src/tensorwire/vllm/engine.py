"""The inference side: a vLLM ``WeightTransferEngine`` that reads each update from a tensorwire
store (backend name ``tensorwire``).

vLLM creates one per worker when ``weight_transfer_config={"backend": "tensorwire"}``; the trainer
side (trainer.py) configures it through ``init_weight_transfer_engine`` with the store's URL and the
prefix to read, then, per update, names the generation to apply. An update is read whole into
staging and checked (reader.py) before ``load_weights`` applies it, so a failed update leaves the
model on its previous generation, whole, and says so (``WeightUpdateFailed``, naming both).

An engine started with ``TENSORWIRE_VLLM_URL`` and ``TENSORWIRE_VLLM_PREFIX`` in its environment is
configured on its own side: it reads only that prefix from only that store (an init naming another
is refused: the engine sends its host's token where it reads), and it
catches up to the newest generation as it starts (a restarted engine needs no trainer to come back
to the current weights; ``tensorwire.vllm.catch_up`` then sets the engine's weight version).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from tensorwire.errors import TensorwireError, WeightUpdateFailed
from tensorwire.logs import event
from tensorwire.security import TlsFiles
from tensorwire.vllm import layout
from tensorwire.vllm.reader import Prefetcher, ReaderOptions, WeightReader

log = logging.getLogger(__name__)

URL_ENV = "TENSORWIRE_VLLM_URL"
PREFIX_ENV = "TENSORWIRE_VLLM_PREFIX"
# An update blocks the engine's serving while it reads: a trainer may not ask for more than this.
MAX_TIMEOUT = 3600.0


@dataclass
class TensorwireInitInfo(WeightTransferInitInfo):
    """What ``init_weight_transfer_engine`` sends (``ReaderOptions``' fields, the credentials
    left out: an engine takes its token and TLS files from its own host, never from the wire)."""

    url: str = ""
    prefix: str = ""
    relay: bool = True
    deltas: bool = True
    verify: bool = False
    timeout: float = 120.0
    prefetch: bool = True
    tls_ca: str | None = None  # a path on the engine's host


@dataclass
class TensorwireUpdateInfo(WeightTransferUpdateInfo):
    """What ``update_weights`` sends: the generation to apply (a number, or "latest")."""

    generation: int | str = field(default="latest")


class TensorwireWeightTransferEngine(WeightTransferEngine[TensorwireInitInfo, TensorwireUpdateInfo]):
    """Reads generations from a tensorwire store into its model; see the module docstring."""

    init_info_cls = TensorwireInitInfo
    update_info_cls = TensorwireUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.reader: WeightReader | None = None
        self.prefetcher: Prefetcher | None = None
        self.generation = 0  # the generation the model holds (0: the checkpoint it started from)
        self.version = "checkpoint"
        self.pinned_prefix = os.environ.get(PREFIX_ENV) or None
        self.pinned_url = os.environ.get(URL_ENV) or None
        if self.pinned_url and self.pinned_prefix:
            self._configure(ReaderOptions(self.pinned_url, self.pinned_prefix))
            self._cold_start()

    # -- vLLM's interface --------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: TensorwireInitInfo) -> None:
        prefix = init_info.prefix or self.pinned_prefix or ""
        if self.pinned_prefix and prefix != self.pinned_prefix:
            raise PermissionError(
                f"this engine reads only {self.pinned_prefix!r} (${PREFIX_ENV}), not {init_info.prefix!r}"
            )
        url = init_info.url or self.pinned_url or ""
        if self.pinned_url and url != self.pinned_url:
            # the engine sends its host's token to this address: only the one it was configured with
            raise PermissionError(
                f"this engine reads only from {self.pinned_url!r} (${URL_ENV}), not {url!r}"
            )
        if not url or not prefix:
            raise ValueError(
                "tensorwire needs the store's url and the prefix to read (init_info url=, prefix=)"
            )
        if not 0 < init_info.timeout <= MAX_TIMEOUT:
            raise ValueError(
                f"an update's timeout is over 0 and at most {MAX_TIMEOUT} s, not {init_info.timeout}"
            )
        tls = TlsFiles(ca=Path(init_info.tls_ca)) if init_info.tls_ca else None
        options = ReaderOptions(
            url, prefix, tls=tls, relay=init_info.relay, deltas=init_info.deltas,
            verify=init_info.verify, timeout=init_info.timeout, prefetch=init_info.prefetch,
        )  # fmt: skip
        self._configure(options)

    def start_weight_update(self) -> None:
        if self.reader is None:
            raise RuntimeError(
                "tensorwire: call init_weight_transfer_engine first (it names the store and prefix)"
            )

    def receive_weights(self, update_info: TensorwireUpdateInfo) -> None:
        if self.reader is None:
            raise RuntimeError(
                "tensorwire: call init_weight_transfer_engine first (it names the store and prefix)"
            )
        self.bring(_generation(update_info.generation))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after receive_weights; apply() already did.
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        """Nothing to do: the update was applied whole in ``receive_weights``."""

    def shutdown(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    # -- the update ------------------------------------------------------------------------------------
    def bring(self, at: int | str) -> int:
        """Bring generation ``at`` into the model; WeightUpdateFailed (the model untouched) if it
        cannot be read whole and checked. Returns the generation the model now holds."""
        assert self.reader is not None
        prefix = self.reader.options.prefix
        try:
            brought = self.reader.bring(at)  # type: ignore[arg-type]
        except (TensorwireError, OSError, TimeoutError, ValueError) as exc:
            raise WeightUpdateFailed(
                f"generation {at} of {prefix!r} was not applied ({exc}); the engine keeps serving "
                f"version {self.version!r} (generation {self.generation}), whole",
                generation=at, serving=self.version,
            ) from exc  # fmt: skip
        if brought.number != self.generation:
            started = time.monotonic()
            with _current(self.vllm_config):  # as vLLM's own reload runs (quantized layers read it)
                apply(self.model, brought.weights, self.model_config, self.device)
            self.generation, self.version = brought.number, brought.version
            event(log, logging.INFO, "weights applied", prefix=prefix, generation=brought.number,
                  version=brought.version, received=brought.received,
                  apply_seconds=round(time.monotonic() - started, 3))  # fmt: skip
        return self.generation

    def _configure(self, options: ReaderOptions) -> None:
        if self.reader is not None and self.reader.options == options:
            return  # the same store and prefix: keep the staging (the next delta's base)
        reference = self._reference()
        self.shutdown()
        self.reader = WeightReader(options, reference)
        if options.prefetch:
            self.prefetcher = Prefetcher(self.reader)

    def _reference(self) -> layout.Reference:
        """The checkpoint the engine was started from: its tensors are what a generation must hold."""
        folder = _checkpoint_folder(
            str(self.model_config.model), getattr(self.model_config, "revision", None)
        )
        return layout.from_checkpoint(folder, getattr(self.model_config, "dtype", None))

    def _cold_start(self) -> None:
        """Catch up to the newest generation as the engine starts (a restarted engine). A store
        that cannot be reached leaves the checkpoint's weights serving: logged as an error, and
        ``catch_up`` (or the trainer's next update) raises it."""
        assert self.reader is not None
        try:
            if self.reader.newest():
                self.bring("latest")
        except (TensorwireError, OSError) as exc:
            event(log, logging.ERROR, "cold start could not catch up: serving the checkpoint's weights",
                  prefix=self.reader.options.prefix, error=repr(exc))  # fmt: skip


def apply(
    model: torch.nn.Module, weights: Mapping[str, torch.Tensor], model_config: Any, device: torch.device
) -> None:
    """``weights`` (checkpoint names) into ``model`` through its own ``load_weights``, so that
    vLLM's fused layouts (qkv, gate_up), renames and sharding apply as for a checkpoint, inside
    vLLM's layerwise reload (which re-runs each layer's post-load processing, for quantized models)."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    load: Callable[[Iterable[tuple[str, torch.Tensor]]], object] = model.load_weights  # type: ignore[assignment]
    initialize_layerwise_reload(model)
    load(weights.items())
    finalize_layerwise_reload(model, model_config)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _current(vllm_config: Any) -> Any:
    from vllm.config import set_current_vllm_config

    return set_current_vllm_config(vllm_config)


def _generation(value: int | str) -> int | str:
    if value == "latest":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"update_info generation must be a number from 1 or 'latest', not {value!r}")
    return value


def _checkpoint_folder(model: str, revision: str | None) -> Path:
    """The local folder of the engine's checkpoint: ``model`` itself, or its Hugging Face cache
    snapshot (never downloaded here: the engine loaded it already)."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, local_files_only=True))
