"""Ray Direct Transport through tensorwire: ``@ray.method(tensor_transport="tensorwire")``.

Ray 2.60's RDT moves the tensors an actor method returns out of band, through a transport
registered with ``ray.experimental.register_tensor_transport``. This module is one, named
``TENSORWIRE`` (Ray upper-cases names; write it in any case), for CPU tensors (and CUDA ones,
copied through host memory; untested here)::

    import ray, torch
    from tensorwire.ray import transport

    transport.register()             # in the driver, before the classes that name it are defined
    ray.init()

    @ray.remote
    class Trainer:
        @ray.method(tensor_transport="tensorwire")
        def weights(self) -> torch.Tensor:
            return torch.randn(1024, 1024)

    @ray.remote(enable_tensor_transport=True)   # Ray's rule for any actor that receives RDT objects
    class Engine:
        def load(self, weights: torch.Tensor) -> float:
            return float(weights.sum())

    ref = Trainer.remote().weights.remote()
    ray.get(Engine.remote().load.remote(ref))   # the engine reads the tensor from the trainer's store
    torch.sum(ray.get(ref))                      # and so can the driver

An actor that receives RDT objects needs ``enable_tensor_transport=True`` (a method that returns
them sets it by itself): without it, Ray runs the transfer on the actor's main thread, behind the
very task that waits for it, and the task fails after Ray's 60 s fetch timeout.

How it moves (one-sided: only the reader acts, as Ray's NIXL transport):

* The sender: Ray calls ``extract_tensor_transport_metadata`` in the actor right after the method
  returns. The first time, the process starts its store: a ``ServerThread`` serving
  ``shm://127.0.0.1:0`` (readers on this node) and ``tcp://NODE_IP:0`` (readers on other nodes),
  with the cluster's token. The tensors are copied into it under ``rdt/<128 random bits>/<i>``,
  and the metadata Ray carries to readers holds those names and the two URLs.
* The reader (another actor, or the driver on ``ray.get``): ``recv_multiple_tensors`` checks the
  metadata (below), connects to the sender's store (shm:// on the sender's node, else tcp://; the
  connection is kept for the next object), STATs the names and compares what the store holds with
  the metadata, then allocates and reads them, each chunk checksummed. Every read is bounded
  (``timeout``): a sender that died gives ``SenderUnreachable`` naming the object, the actor's
  store and the reason, never a hang.
* Freeing: when the last ``ObjectRef`` goes, Ray calls ``garbage_collect`` in the sender, which
  deletes the names from its store (its bytes go back down; ``local_store_stats``).

Security. The token is one secret per driver: ``register(token=...)``, else ``$TENSORWIRE_RDT_TOKEN``
in the driver, else a fresh random one. It reaches the actors inside the transport class Ray sends
each actor to register (a task argument: Ray's control plane carries it, as it would a
``runtime_env`` variable), so an actor needs no configuration. Every reader authenticates like any
client (a wrong token is refused at HELLO). The store is read-only to the network: PUT, DELETE
and LIST are refused (``NotAuthorized``), only the actor's own process puts and deletes, so a client
holding the token still cannot list names, and a name is a 128-bit random capability: a reader that
was not handed an object's metadata cannot guess it. What a reader takes from metadata is checked
before it allocates or connects (``check_metadata``): the number of tensors, each dtype (one the
wire carries) and shape (``max_ndim`` non-negative ints), the total bytes (``max_object_bytes``),
the names' form, the URLs' schemes and hosts (shm:// only on loopback, tcp:// only at the address
of the sender's Ray node); then what the store says it holds must equal the metadata.

Modules: this one holds Ray's interface (``TensorwireTransport``, ``register``) and the reader's
side; ``rdt_metadata.py`` the metadata and its checks; ``rdt_store.py`` the sender's store. The
names tests and benches use (``TensorwireMetadata``, ``InvalidMetadata``, ``check_metadata``, ...)
are importable from here as before.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import secrets
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, cast

import ray
import torch
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

from tensorwire.client.core import Client, connect
from tensorwire.errors import ClusterError, KeyNotFound, TransportError
from tensorwire.ray.rdt_metadata import (
    DEVICES,
    LIMITS,
    InvalidMetadata,
    NodeAddress,
    TensorwireCommunicatorMetadata,
    TensorwireMetadata,
    check_metadata,
)
from tensorwire.ray.rdt_store import Sender
from tensorwire.types import GiB, MiB

log = logging.getLogger(__name__)

NAME = "TENSORWIRE"  # what Ray keys the transport by; tensor_transport="tensorwire" works too
TOKEN_ENV = "TENSORWIRE_RDT_TOKEN"
HUGE_MIN = 2 * MiB  # a read buffer from here up is mapped for huge pages (empty_host)


class SenderUnreachable(ClusterError):
    """The store of the actor that produced an object could not be read (it died, or its node)."""


class ObjectNotFound(ClusterError):
    """The sender's store does not hold the object (freed already, or forged names)."""


# -- the reader's side -----------------------------------------------------------------------------
def _node_id() -> str:
    return str(ray.get_runtime_context().get_node_id())


class _RayNodes:
    """The address of a Ray node by its id, from Ray's node table (asked again for an unknown id)."""

    def __init__(self) -> None:
        self.nodes: dict[str, str] = {}

    def __call__(self, node_id: str) -> str | None:
        if node_id not in self.nodes:
            self.nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}  # type: ignore[no-untyped-call]
        return self.nodes.get(node_id)


def empty_host(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor for a read to land in. A large one is an anonymous mapping the kernel may
    back with transparent huge pages (MADV_HUGEPAGE): its first touch then faults once per 2 MiB,
    not once per 4 KiB page, which costs more than the copy itself (the read lands 3x faster here).
    The tensor keeps the mapping alive; freeing the tensor unmaps it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_MIN or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(tuple(shape), dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


class _Reader:
    """This process's connections to other processes' stores, one per URL, kept for the next read."""

    def __init__(self, token: str, timeout: float, node_id: str, node_address: NodeAddress) -> None:
        self.token, self.timeout = token, timeout
        self.clients: dict[str, Client] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.lock = threading.Lock()
        self.node_id, self.node_address = node_id, node_address

    @contextmanager
    def client(self, url: str) -> Iterator[Client]:
        with self.lock:
            lock = self.locks.setdefault(url, threading.Lock())
        with lock:
            client = self.clients.get(url)
            if client is None:
                t = self.timeout
                client = connect(url, token=self.token, timeout=t, connect_timeout=min(t, 5.0), retries=1)
                self.clients[url] = client
            try:
                yield client
            except BaseException:
                self.clients.pop(url, None)  # a broken or dead peer: a fresh connection next time
                client.close()
                raise

    def read(
        self, obj_id: str, meta: TensorwireMetadata, out: list[torch.Tensor] | None, allocate: Any
    ) -> list[torch.Tensor]:
        if not meta.names:
            return []
        url = meta.shm_url if meta.node_id == self.node_id else meta.tcp_url
        try:
            with self.client(url) as client:
                for i, (name, (shape, dtype)) in enumerate(zip(meta.names, meta.tensor_meta, strict=True)):
                    held = client.stat(name)
                    if held.dtype != dtype or held.shape != tuple(shape):
                        raise InvalidMetadata(
                            f"tensor {i}: the metadata says {dtype} {tuple(shape)}, the store holds "
                            f"{held.dtype} {held.shape}"
                        )
                tensors = out if out is not None else allocate()
                host = [t if t.device.type == "cpu" else empty_host(t.shape, t.dtype) for t in tensors]
                got = client.get_many(meta.names, out=dict(zip(meta.names, host, strict=True)))
                for t, h, name in zip(tensors, host, meta.names, strict=True):
                    if got[name] is not h:
                        raise InvalidMetadata(f"{name} did not land in its buffer")
                    if t is not h:
                        t.copy_(h)
                return tensors
        except KeyNotFound as exc:
            raise ObjectNotFound(
                f"tensorwire RDT: the sender's store at {url} does not hold object {obj_id} (freed "
                f"already, or metadata that is not this object's): {exc}"
            ) from exc
        except TransportError as exc:
            raise SenderUnreachable(
                f"tensorwire RDT: could not read object {obj_id} from its sender's store at {url} "
                f"(the actor that produced it may have died): {type(exc).__name__}: {exc}"
            ) from exc


# -- Ray's interface -------------------------------------------------------------------------------
class TensorwireTransport(TensorTransportManager):
    """Ray's ``TensorTransportManager`` over tensorwire; ``register`` makes the subclass Ray uses
    (with the token and bounds as class attributes, so they travel to every actor with it)."""

    token: ClassVar[str] = ""
    capacity: ClassVar[int] = 8 * GiB
    timeout: ClassVar[float] = 30.0  # one read; below Ray's own 60 s fetch timeout
    max_object_bytes: ClassVar[int] = LIMITS.max_request_bytes

    def __init__(self) -> None:
        self._sender: Sender | None = None
        self._reader: _Reader | None = None
        self._lock = threading.Lock()
        self._aborted: set[str] = set()

    def sender(self) -> Sender:
        with self._lock:
            if self._sender is None:
                host = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
                self._sender = Sender(self._token(), self.capacity, host, _node_id())
            return self._sender

    def reader(self) -> _Reader:
        with self._lock:
            if self._reader is None:
                self._reader = _Reader(self._token(), self.timeout, _node_id(), _RayNodes())
            return self._reader

    def _token(self) -> str:
        if not self.token:
            raise ClusterError(
                "the tensorwire RDT transport was not registered with a token: call register()"
            )
        return self.token

    def tensor_transport_backend(self) -> str:
        return NAME

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True  # a read is bounded by ``timeout``; an abort makes the next one fail at once

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        return True  # any process with tensorwire; its store starts on its first object

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> TensorwireMetadata:
        device = rdt_object[0].device.type if rdt_object else None
        if any(t.device.type != device for t in rdt_object):
            raise ValueError("All tensors in an RDT object must have the same device type.")
        sender = self.sender()
        names = sender.put(obj_id, rdt_object)
        return TensorwireMetadata(
            tensor_meta=[(t.shape, t.dtype) for t in rdt_object],
            tensor_device=device,
            names=names,
            shm_url=sender.shm_url,
            tcp_url=sender.tcp_url,
            node_id=sender.node_id,
        )

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: str | None = None
    ) -> TensorwireCommunicatorMetadata:
        return TensorwireCommunicatorMetadata()

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        reader = self.reader()
        meta = check_metadata(tensor_transport_metadata, self.max_object_bytes, reader.node_address)
        if obj_id in self._aborted:
            raise SenderUnreachable(f"tensorwire RDT: the read of object {obj_id} was aborted")
        device = meta.tensor_device or "cpu"

        specs = cast(list[tuple[tuple[int, ...], torch.dtype]], meta.tensor_meta)  # checked above

        def allocate() -> list[torch.Tensor]:
            if device == "cpu":
                return [empty_host(s, d) for s, d in specs]
            return [torch.empty(s, dtype=d, device=device) for s, d in specs]

        return reader.read(obj_id, meta, target_buffers, allocate)

    def send_multiple_tensors(
        self,
        tensors: list[Any],
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
    ) -> None:
        raise NotImplementedError("the tensorwire transport is one-sided: readers read, senders do not send")

    def garbage_collect(
        self, obj_id: str, tensor_transport_meta: TensorTransportMetadata, tensors: list[Any]
    ) -> None:
        if self._sender is not None:
            self._sender.free(obj_id)

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        self._aborted.add(obj_id)


def local_store_stats() -> dict[str, int]:
    """This process's RDT store: its tensors and bytes (zeros before its first object). Call it
    in an actor with ``actor.__ray_call__.remote(lambda self: local_store_stats())``."""
    sender = _local_sender()
    if sender is None:
        return {"tensors": 0, "bytes": 0, "objects": 0}
    return {"tensors": len(sender.store), "bytes": sender.store.stored, "objects": len(sender.objects)}


def local_store_urls() -> tuple[str, str] | None:
    """This process's RDT store's shm:// and tcp:// URLs (None before its first object)."""
    sender = _local_sender()
    return None if sender is None else (sender.shm_url, sender.tcp_url)


def _local_sender() -> Sender | None:
    """This process's sender, if it made one. Ray registers the transport on an actor with a task
    of its own, which a call of the actor's may overtake: not registered yet, it has no store."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    try:
        manager = get_tensor_transport_manager(NAME)
    except ValueError:  # "Unsupported tensor transport protocol": not registered here (yet)
        return None
    return manager._sender if isinstance(manager, TensorwireTransport) else None


# -- registration (the driver) ---------------------------------------------------------------------
_registered: type[TensorwireTransport] | None = None


def register(
    token: str | None = None,
    *,
    capacity: int = 8 * GiB,
    timeout: float = 30.0,
    max_object_bytes: int = LIMITS.max_request_bytes,
) -> str:
    """Register the ``TENSORWIRE`` transport in this (the driver's) process; call it before creating
    the actors that use it (Ray registers it on each actor it creates after). Returns the token:
    ``token``, else ``$TENSORWIRE_RDT_TOKEN``, else a fresh random one. ``capacity``: each actor's
    store (bytes); ``timeout``: one read (seconds); ``max_object_bytes``: the most a reader
    allocates for one object. A second call returns the first call's token (its settings stay)."""
    global _registered
    from ray.experimental import register_tensor_transport

    if _registered is not None:
        if token is not None and token != _registered.token:
            raise ValueError("the tensorwire RDT transport is registered already, with another token")
        return _registered.token
    chosen = token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(32)
    # A class made here, not importable by name: Ray's cloudpickle sends it by value, its class
    # attributes (the token, the bounds) with it, to every actor it registers the transport on.
    cls = type(
        "RegisteredTensorwireTransport",
        (TensorwireTransport,),
        {"token": chosen, "capacity": capacity, "timeout": timeout, "max_object_bytes": max_object_bytes,
         "__module__": __name__, "__qualname__": "register.<locals>.RegisteredTensorwireTransport"},
    )  # fmt: skip
    register_tensor_transport(NAME, list(DEVICES), cls, torch.Tensor)
    _registered = cls
    return chosen


__all__ = [
    "NAME", "TOKEN_ENV", "InvalidMetadata", "ObjectNotFound", "SenderUnreachable",
    "TensorwireCommunicatorMetadata", "TensorwireMetadata", "TensorwireTransport", "check_metadata",
    "empty_host", "local_store_stats", "local_store_urls", "register",
]  # fmt: skip
