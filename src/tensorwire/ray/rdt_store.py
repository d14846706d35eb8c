"""The sender's side of the tensorwire RDT transport (``transport.py``): the store and server each
process starts on its first RDT object, which the actor's returned tensors are copied into and
which readers read from. Its own module because it is the part that owns a server and the
lifetime of the names in it (``put`` under fresh random names, ``free`` when Ray collects the
object); the transport only wires it to Ray's calls.

The store is read-only to the network (``OwnStore``): PUT, DELETE and LIST are refused
(``NotAuthorized``), only the process itself puts and deletes, inside ``owner()``.
"""

from __future__ import annotations

import atexit
import secrets
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from tensorwire.errors import NotAuthorized
from tensorwire.ray.rdt_metadata import PREFIX
from tensorwire.server.core import ServerThread
from tensorwire.server.options import ServerOptions
from tensorwire.store import TensorStore
from tensorwire.store.memory import Reservation
from tensorwire.types import Address, TensorMeta
from tensorwire.wire.tensors import byte_view


class OwnStore(TensorStore):
    """A store only its own process writes: the network may read what it is told the names of, but
    never put, delete or list (``NotAuthorized``). The process writes inside ``owner()``."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._owner = threading.local()

    @contextmanager
    def owner(self) -> Iterator[None]:
        self._owner.active = True
        try:
            yield
        finally:
            self._owner.active = False

    def _mine(self, what: str) -> None:
        if not getattr(self._owner, "active", False):
            raise NotAuthorized(f"this store is an actor's RDT store: {what} is not open to its clients")

    def reserve(self, metas: Sequence[TensorMeta], extend: Reservation | None = None) -> Reservation:
        self._mine("put")
        return super().reserve(metas, extend)

    def delete(self, names: Sequence[str]) -> int:
        self._mine("delete")
        return super().delete(names)

    def list(self, prefix: str = "", limit: int = 0) -> list[TensorMeta]:
        raise NotAuthorized("this store is an actor's RDT store: its names are not listed")


class Sender:
    """This process's store and server, started on its first object."""

    def __init__(self, token: str, capacity: int, host: str, node_id: str) -> None:
        self.store = OwnStore(capacity)
        urls = ["shm://127.0.0.1:0", str(Address("tcp", host, 0))]
        self.server = ServerThread(urls, ServerOptions(token=token), store=self.store)
        by_scheme = {a.scheme: str(a) for a in self.server.addresses}
        self.shm_url, self.tcp_url = by_scheme["shm"], by_scheme["tcp"]
        self.node_id = node_id
        self.objects: dict[str, list[str]] = {}  # Ray's object id -> its names here
        self.lock = threading.Lock()
        atexit.register(self.server.close)  # unlinks the shared-memory segments

    def put(self, obj_id: str, tensors: Sequence[torch.Tensor]) -> list[str]:
        key = secrets.token_hex(16)  # 128 random bits: the capability to read this object
        names = [f"{PREFIX}/{key}/{i}" for i in range(len(tensors))]
        hosts = [_host_copy(t) for t in tensors]
        with self.store.owner():
            res = self.store.reserve([TensorMeta.of(n, t) for n, t in zip(names, hosts, strict=True)])
        try:
            for buf, t in zip(res.buffers, hosts, strict=True):
                if t.nbytes:
                    buf[:] = byte_view(t)
            self.store.commit(res)
        except BaseException:
            self.store.abort(res)
            raise
        with self.lock:
            old = self.objects.pop(obj_id, None)
            self.objects[obj_id] = names
        if old:  # a retried task described again: its first copy is not Ray's any more
            self.delete(old)
        return names

    def free(self, obj_id: str) -> None:
        with self.lock:
            names = self.objects.pop(obj_id, None)
        if names:
            self.delete(names)

    def delete(self, names: list[str]) -> None:
        with self.store.owner():
            self.store.delete(names)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor (a CUDA tensor copied to host memory, after its stream)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")  # synchronous: waits for the work that produced it
    return t.contiguous()


__all__ = ["OwnStore", "Sender"]
