"""Which route a put or a get takes: the one question both the ``AsyncClient`` and the blocking
client's inline path (inline.py) ask, so that the two never disagree.

A put of one tensor takes one of five routes, a get into one tensor one of five, chosen in this
order from what the transport can do (its capabilities, ``transport/base.py``; never its scheme),
the tensor's device and size, and the client's options:

========== ======================================================= ==========================
route      when                                                    how (module)
========== ======================================================= ==========================
DIRECT     a CUDA tensor, and the transport moves device memory    ``DeviceDirect``
           itself now (``gpu_direct``)
STAGED     a CUDA tensor, and the transport is ``Ranged``          pinned host buffers
                                                                   (staging.py)
HOST       (get) a CUDA ``out`` on any other transport             through a CPU tensor
STRIPED    at least ``stripe_bytes`` with ``stripes`` other than   several connections
           1, a ``Ranged`` transport that is ``parallel``, and     (stripe.py)
           (get) no ``out`` or a contiguous CPU one
RESUMABLE  (put) at least ``resumable_bytes``, a ``Resumable``     PUT_RESUMABLE
           transport
PLAIN      everything else                                         one PUT or GET
========== ======================================================= ==========================

The PLAIN get is the same operation on either side (``plain_get``).

A get's size is known from its ``out``, or from the last transfer of the same name this client
made (``moved``): a get of a name never moved before, with no ``out``, is never striped.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from tensorwire.client import stripe
from tensorwire.client.batches import Landing
from tensorwire.client.options import ClientOptions
from tensorwire.transport.base import DeviceDirect, Ranged, Resumable, Transport

SIZES_KEPT = 65536  # names whose size a client remembers: a hint, not a registry


class Route(enum.Enum):
    DIRECT = "direct"
    STAGED = "staged"
    HOST = "host"
    STRIPED = "striped"
    RESUMABLE = "resumable"
    PLAIN = "plain"


class Routes:
    """One client's answers to "which route?", and the sizes of the tensors it moved."""

    def __init__(self, options: ClientOptions) -> None:
        self._options = options
        self._sizes: dict[str, int] = {}

    def put(self, t: Transport, nbytes: int, cuda: bool) -> Route:
        """The route of a put of ``nbytes`` (from a CUDA tensor: ``cuda``) over ``t``'s kind."""
        if cuda and direct(t):
            return Route.DIRECT
        if cuda and isinstance(t, Ranged):
            return Route.STAGED
        if self.stripes(nbytes) > 1 and _stripes_pay(t):
            return Route.STRIPED
        resumable = self._options.resumable_bytes
        if resumable and nbytes >= resumable and isinstance(t, Resumable):
            return Route.RESUMABLE
        return Route.PLAIN

    def get(self, t: Transport, name: str, out: torch.Tensor | None) -> Route:
        """The route of a get of ``name`` into ``out`` (None: a new tensor) over ``t``'s kind."""
        if out is not None and out.is_cuda:
            if direct(t):
                return Route.DIRECT
            return Route.STAGED if isinstance(t, Ranged) else Route.HOST
        into = out is None or (out.is_cpu and out.is_contiguous())
        if into and self.stripes(self.size(name, out)) > 1 and _stripes_pay(t):
            return Route.STRIPED
        return Route.PLAIN

    def stripes(self, nbytes: int) -> int:
        """Over how many connections ``nbytes`` would travel, where the transport allows: asked
        first, since it costs nothing and is 1 for most tensors."""
        return stripe.stripe_count(nbytes, self._options.stripes, self._options.stripe_bytes)

    def size(self, name: str, out: torch.Tensor | None) -> int:
        """The bytes a get of ``name`` into ``out`` will move, as far as this client knows (0: not)."""
        return out.numel() * out.element_size() if out is not None else self._sizes.get(name, 0)

    def moved(self, name: str, nbytes: int) -> None:
        """A transfer of ``name`` moved ``nbytes``: what the next get of it is routed by."""
        if len(self._sizes) >= SIZES_KEPT:  # start over rather than grow
            self._sizes.clear()
        self._sizes[name] = nbytes


def direct(t: Transport) -> bool:
    """Whether ``t`` moves CUDA tensors straight from and into device memory now."""
    return isinstance(t, DeviceDirect) and t.gpu_direct


def _stripes_pay(t: Transport) -> bool:
    """Whether ``t`` can stripe, and says it pays: ``Ranged`` and ``parallel``."""
    return isinstance(t, Ranged) and t.parallel


def plain_get(
    name: str, out: torch.Tensor | None, progress: Callable[[int], None] | None = None
) -> Callable[[Transport], Coroutine[Any, Any, tuple[torch.Tensor, int]]]:
    """The PLAIN route of a get: one GET of ``name`` into ``out`` (None: a new tensor), as an
    operation on a connection that answers with the tensor and the version read; each attempt
    lands afresh."""
    landing = Landing([name], {name: out} if out is not None else {})

    async def op(t: Transport) -> tuple[torch.Tensor, int]:
        landing.reset()
        await t.get([name], landing.sink, progress)
        return landing.finish()[name], landing.versions[name]

    return op
