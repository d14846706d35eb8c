"""The client's tensor cache: a ``get`` of an unchanged tensor costs one STAT, or nothing.

Each cached copy remembers the version it was read at and the identity of the store that answered
(``ServerInfo.store_id``, from HELLO): a version number means the same bytes only within one store
(a restarted in-memory server counts from 1 again), so a copy is only ever confirmed by an answer
from the same store, and a server that does not say who it is (gRPC, or older than store ids) gets
nothing cached (``unverifiable`` counts those reads). A ``get`` of a cached name within its lease
(``ClientOptions.cache_lease`` seconds since the version was last confirmed) is answered from the
copy with no request at all; after the lease, one STAT (a few dozen bytes each way) confirms the
version, or the tensor is read again. So with a lease of 0 (the default) a get never returns a
tensor older than the server's at the time of the call; with a lease of L seconds it may return
one up to L seconds stale, and only while the connection it was confirmed on is up (or a new one
reached the same store). A put or delete by this client drops its own copy at once.

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
    store: int  # the store_id of the server that answered (never 0: unknown stores are not cached)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def matches(self, meta: TensorMeta, store: int) -> bool:
        """Whether ``meta``, answered by the store ``store``, says this copy is still current."""
        return (
            store == self.store
            and meta.version == self.version
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
        self.unverifiable = 0  # reads not cached: the server did not say which store answered
        self._entries: OrderedDict[str, Cached] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def lookup(self, name: str) -> Cached | None:
        entry = self._entries.get(name)
        if entry is not None:
            self._entries.move_to_end(name)
        return entry

    def leased(self, entry: Cached, store: int) -> bool:
        """Whether ``entry`` may be handed out without asking the server (``store``: the identity
        of the store the client is connected to now, 0 if it is not connected)."""
        return self.lease > 0 and store == entry.store and time.monotonic() - entry.confirmed < self.lease

    def confirm(self, entry: Cached) -> None:
        entry.confirmed = time.monotonic()

    def store(self, name: str, version: int, tensor: torch.Tensor, store: int) -> None:
        """Keep a private copy of ``tensor`` (read at ``version`` from the store ``store``), if it
        fits and the store is known (0: not cached, counted in ``unverifiable``)."""
        self.invalidate(name)
        nbytes = tensor.numel() * tensor.element_size()
        if not store:
            self.unverifiable += 1
            return
        if nbytes > self.max_bytes or not tensor.is_cpu:
            return
        while self.used + nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.used -= old.nbytes
        self._entries[name] = Cached(version, tensor.detach().clone(), time.monotonic(), store)
        self.used += nbytes

    def invalidate(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            self.used -= entry.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0
