"""A tensor's bytes as a ``memoryview``, with no copy: through numpy, which every torch build has.

``views_c.pyx`` is the compiled route to the same views (``views`` picks one): it asks the tensor
for its data pointer and exports the bytes itself, about a fifth of this route's cost, and comes
here for every tensor it does not handle itself."""

from __future__ import annotations

import torch

_NUMPY_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
     torch.uint64, torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128}
)  # fmt: skip


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable flat ``memoryview`` of a contiguous CPU tensor's bytes (format ``B``); it keeps
    the tensor alive. TypeError for a tensor numpy cannot view (another device, not contiguous),
    RuntimeError for one whose values its bytes do not hold (a conjugate or negative view)."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.dtype in _NUMPY_DTYPES:  # the direct route costs half of the reinterpreting one
        return tensor.numpy().data.cast("B")
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def copy_out(staged: memoryview, run: list[memoryview], first: int, last: int, pos: int) -> int:
    """Copy ``staged`` from byte ``pos`` on into the views ``run[first:last]``, one after another,
    and return where the copy stopped: the receive path's way out of a staging buffer for a run
    of small tensors (``transport/frame_io.py``). ValueError if ``staged`` runs out first."""
    for dest in run[first:last]:
        end = pos + dest.nbytes
        dest[:] = staged[pos:end]
        pos = end
    return pos
