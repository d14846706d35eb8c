"""vLLM's plugin entry point (``vllm.general_plugins``, ``tensorwire.vllm.plugin:register``): vLLM
calls it in every process it starts, so the ``tensorwire`` backend is known wherever an engine or a
trainer asks for it by name."""

from __future__ import annotations

BACKEND = "tensorwire"


def register() -> None:
    """Register the backend with vLLM's weight-transfer factories (the plugin entry point; vLLM
    calls it in every process it starts). Registering twice does nothing."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "tensorwire.vllm.engine", "TensorwireWeightTransferEngine"
        )
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "tensorwire.vllm.trainer", "TensorwireTrainerWeightTransferEngine"
        )
