"""Byte views of tensors, with no copy of the tensor's data."""

from __future__ import annotations

import torch

from tensorwire.errors import InvalidTensor
from tensorwire.types import TensorMeta
from tensorwire.wire.dtypes import DTYPE_TO_CODE
from tensorwire.wire.views import byte_view

__all__ = ["byte_view", "check_out", "empty_for", "sendable"]


def sendable(tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """The tensor as a contiguous CPU tensor: itself when it already is (no copy), else one copy.

    Non-contiguous tensors are sent contiguous; the receiver sees the same values and shape.
    """
    # Called once per tensor of every put: each check below is the cheapest torch offers.
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTensor(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPE_TO_CODE:
        raise InvalidTensor(f"{name!r}: dtype {tensor.dtype} cannot be sent (quantized or unknown)")
    if tensor.layout is not torch.strided:
        raise InvalidTensor(f"{name!r}: only dense (strided) tensors can be sent, not {tensor.layout}")
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def empty_for(meta: TensorMeta) -> torch.Tensor:
    """A new uninitialised tensor with ``meta``'s dtype and shape."""
    return torch.empty(meta.shape, dtype=meta.dtype)


def check_out(meta: TensorMeta, out: torch.Tensor, device_ok: bool = False) -> None:
    """Raise InvalidTensor unless ``out`` can receive the tensor described by ``meta`` in place
    (on the CPU, unless ``device_ok``: the client stages device tensors through host buffers)."""
    if out.dtype != meta.dtype or tuple(out.shape) != meta.shape:
        raise InvalidTensor(
            f"{meta.name!r}: out is {out.dtype}{list(out.shape)}, stored tensor is "
            f"{meta.dtype}{list(meta.shape)}"
        )
    if not out.is_cpu and not device_ok:
        raise InvalidTensor(f"{meta.name!r}: out must be a CPU tensor, not {out.device}")
