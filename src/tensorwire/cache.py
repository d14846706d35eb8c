"""The client's tensor cache: a ``get`` of an unchanged tensor costs one STAT, or nothing.

Each cached copy remembers the version it was read at. A ``get`` of a cached name within its lease
(``ClientOptions.cache_lease`` seconds since the version was last confirmed) is answered from the
copy with no request at all; after the lease, one STAT (a few dozen bytes each way) confirms the
version, or the tensor is read again. So with a lease of 0 (the default) a get never returns a
tensor older than the server's at the time of the call; with a lease of L seconds it may return
one up to L seconds stale. A put or delete by this client drops its own copy at once.

Copies are private: a hit hands out a copy of the cached tensor (or fills ``out``), so the caller
can never change what the cache holds. Bounded by ``ClientOptions.cache_bytes``, least recently
used first out.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tensorwire.types import TensorMeta


@dataclass(slots=True)
class Cached:
    version: int
    tensor: torch.Tensor
    confirmed: float  # time.monotonic() when the server last said this version is current

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def matches(self, meta: TensorMeta) -> bool:
        return (
            meta.version == self.version
            and meta.dtype == self.tensor.dtype
            and meta.shape == tuple(self.tensor.shape)
        )

    def hand_out(self, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return self.tensor.clone()
        return out.copy_(self.tensor)


class TensorCache:
    def __init__(self, max_bytes: int, lease: float) -> None:
        self.max_bytes = max_bytes
        self.lease = lease
        self.used = 0
        self.hits = 0
        self.checks = 0  # hits that cost a STAT
        self._entries: OrderedDict[str, Cached] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def lookup(self, name: str) -> Cached | None:
        entry = self._entries.get(name)
        if entry is not None:
            self._entries.move_to_end(name)
        return entry

    def leased(self, entry: Cached) -> bool:
        """Whether ``entry`` may be handed out without asking the server."""
        return self.lease > 0 and time.monotonic() - entry.confirmed < self.lease

    def confirm(self, entry: Cached) -> None:
        entry.confirmed = time.monotonic()

    def store(self, name: str, version: int, tensor: torch.Tensor) -> None:
        """Keep a private copy of ``tensor`` (read at ``version``), if it fits."""
        self.invalidate(name)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.max_bytes or not tensor.is_cpu:
            return
        while self.used + nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.used -= old.nbytes
        self._entries[name] = Cached(version, tensor.detach().clone(), time.monotonic())
        self.used += nbytes

    def invalidate(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            self.used -= entry.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0
