"""Error feedback: what a lossy codec drops from one step's gradient is added to the next one's.

::

    feedback = ErrorFeedback(codec_for("topk:0.01"))
    payload = feedback.encode("fc1.weight", grad)   # grad now holds what the receiver will decode

For each tensor the worker keeps a residual ``r`` (zeros at first) and sends, every step,
``encode(g + r)``; then ``r = (g + r) - decode(...)``. Nothing is lost, only delayed: the sum of
what was sent over t steps equals the sum of the true gradients minus the last residual, so
top-k at 1 % still moves every coordinate, once its accumulated gradient is large enough
(Stich et al. 2018; Karimireddy et al. 2019).

Memory: one residual per tensor, of the tensor's size and dtype, i.e. one more copy of the
gradients (the model's size again) on each worker; ``nbytes`` says how much. The decode into the
gradient's own memory needs no further buffer.
"""

from __future__ import annotations

import torch

from tensorwire.compression.codecs import Codec


class ErrorFeedback:
    """The residuals of one worker's tensors under one codec (see the module doc)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.residuals: dict[str, torch.Tensor] = {}

    def encode(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """The payload of ``grad`` plus the residual of ``key``. ``grad`` (contiguous, owned by the
        caller) is overwritten with the decoded value; the residual keeps what it lacks."""
        residual = self.residuals.get(key)
        if residual is None or residual.shape != grad.shape or residual.dtype != grad.dtype:
            residual = self.residuals[key] = torch.zeros_like(grad)
        residual.add_(grad)
        payload = self.codec.encode(residual)
        self.codec.decode(payload, grad)
        residual.sub_(grad)
        return payload

    @property
    def nbytes(self) -> int:
        """Memory the residuals take."""
        return sum(r.numel() * r.element_size() for r in self.residuals.values())

    def reset(self) -> None:
        self.residuals.clear()
