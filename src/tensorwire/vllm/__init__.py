"""tensorwire as vLLM's weight-transfer backend (``pip install tensorwire[vllm]``).

A trainer publishes one generation of its weights per update under a prefix of a tensorwire store;
each engine worker reads it (through the relay when several engines read one generation, as a
delta when it holds the previous one, every chunk checked) and applies it through the model's own
``load_weights``. The generation's number, or the version string the trainer gives, becomes the
engine's weight version; an update that fails leaves the engine on its previous version, whole.

vLLM finds the backend through its plugin entry point (``vllm.general_plugins``: ``register``), so
``LLM(..., weight_transfer_config={"backend": "tensorwire"})`` (or ``vllm serve
--weight-transfer-config '{"backend": "tensorwire"}'``) is all an engine sets. The trainer::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from tensorwire.vllm import TensorwireTrainerInitInfo

    info = TensorwireTrainerInitInfo(rank=0, url="tcp://store:7000", prefix="policy")
    sender = WeightTransferTrainerFactory.trainer_init(info, client=engines, source=ModuleSource(model))
    sender.send_weights(version="step-1")  # publish, then every engine applies it

docs/howto/engines-vllm.md is the guide (torchrun and Ray); engine.py, trainer.py, reader.py, publisher.py and
layout.py say how each side works. Only engine.py and trainer.py import vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorwire.vllm.clients import Engines
from tensorwire.vllm.layout import MAX_VERSION_BYTES, VERSION_KEY, Reference, decode_version
from tensorwire.vllm.plugin import BACKEND, register
from tensorwire.vllm.publisher import PublisherOptions, WeightPublisher
from tensorwire.vllm.reader import Brought, ReaderOptions, WeightReader

if TYPE_CHECKING:
    from tensorwire.vllm.trainer import TensorwireTrainerInitInfo


def catch_up(llm: Any, url: str, prefix: str, *, token: str | None = None, timeout: float = 120.0) -> str:
    """Bring an engine (an ``LLM``, or anything with its four weight-sync methods) to the newest
    generation of ``prefix`` and set its weight version to that generation's: what an engine
    restarted mid-run calls (one started with ``TENSORWIRE_VLLM_URL``/``_PREFIX`` has brought the
    weights in already as it started; then only the version is set). Returns the version."""
    import torch

    from tensorwire.client.core import connect

    with connect(url, token=token, timeout=timeout) as client:
        manifest = client.manifest(prefix)
        number = manifest.generation.number
        version = str(number)
        if any(e.meta.name == f"{prefix}/{VERSION_KEY}" for e in manifest.tensors):
            # into a record of its fixed size: a store that says otherwise is refused, not read
            record = torch.zeros(MAX_VERSION_BYTES, dtype=torch.uint8)
            client.get(f"{prefix}/{VERSION_KEY}", out=record, at=number)
            version = decode_version(record, number)
    llm.init_weight_transfer_engine({"init_info": {"url": url, "prefix": prefix, "timeout": timeout}})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"generation": number}})
    llm.finish_weight_update(weight_version=version)
    return version


__all__ = [
    "BACKEND",
    "Brought",
    "Engines",
    "PublisherOptions",
    "ReaderOptions",
    "Reference",
    "TensorwireTrainerInitInfo",
    "WeightPublisher",
    "WeightReader",
    "catch_up",
    "register",
]


def __getattr__(name: str) -> Any:
    """The vLLM-side classes, imported (with vLLM) only when asked for."""
    if name == "TensorwireTrainerInitInfo":
        from tensorwire.vllm.trainer import TensorwireTrainerInitInfo

        return TensorwireTrainerInitInfo
    if name in ("TensorwireInitInfo", "TensorwireWeightTransferEngine"):
        from tensorwire.vllm import engine

        return getattr(engine, name)
    raise AttributeError(name)
