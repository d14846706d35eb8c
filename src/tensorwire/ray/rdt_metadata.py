"""What the tensorwire RDT transport (``transport.py``) puts in the metadata Ray carries from the
actor that produced an object to its readers, and the checks a reader makes of it.

The metadata comes from a peer, so a reader treats it as untrusted: ``check_metadata`` refuses
(``InvalidMetadata``, naming the field) anything this transport would not have made, before the
reader allocates a buffer or connects anywhere: the number of tensors, each dtype (one the wire
carries) and shape (``max_ndim`` non-negative ints), the total bytes (``max_object_bytes``), the
names' form (``NAME_RE``), the URLs' schemes and hosts (shm:// only on loopback, tcp:// only at the
address of the sender's Ray node). Its own module so that these checks, which
tests/adversarial/test_ray_rdt_peers.py drives with forged metadata, read apart from the moving.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from ray.experimental.rdt.tensor_transport_manager import CommunicatorMetadata, TensorTransportMetadata

from tensorwire.errors import TensorwireError
from tensorwire.security import is_loopback
from tensorwire.types import Address, Limits
from tensorwire.wire.dtypes import SUPPORTED_DTYPES

PREFIX = "rdt"
MAX_TENSORS = 65536  # in one object
NAME_RE = re.compile(rf"{PREFIX}/[0-9a-f]{{32}}/(0|[1-9][0-9]{{0,5}})")
DEVICES = ("cpu", "cuda")
LIMITS = Limits()


NodeAddress = Callable[[str], "str | None"]  # a Ray node's address by its id (None: no such node)


class InvalidMetadata(TensorwireError, ValueError):
    """The RDT metadata a reader was given is not what this transport makes: refused before it
    allocates or connects."""


# -- what travels in Ray's metadata ----------------------------------------------------------------
@dataclass
class TensorwireMetadata(TensorTransportMetadata):
    """Ray's tensor metadata (shapes, dtypes, device) and where the tensors are: the names in the
    sender's store, its URLs and its Ray node."""

    names: list[str] = field(default_factory=list)
    shm_url: str = ""
    tcp_url: str = ""
    node_id: str = ""


@dataclass
class TensorwireCommunicatorMetadata(CommunicatorMetadata):
    """Nothing: a reader needs only the object's metadata."""


# -- what a reader checks -------------------------------------------------------------------------
def check_metadata(meta: object, max_object_bytes: int, node_address: NodeAddress) -> TensorwireMetadata:
    """``meta`` as a ``TensorwireMetadata`` whose every field a reader uses is sane, else
    ``InvalidMetadata`` naming the field. ``node_address(node_id)`` is the address of a Ray node
    (None if unknown): a tcp:// URL must point there."""
    if not isinstance(meta, TensorwireMetadata):
        raise InvalidMetadata(f"metadata of type {type(meta).__name__}, not TensorwireMetadata")
    entries, names = meta.tensor_meta, meta.names
    if not isinstance(entries, list) or not isinstance(names, list):
        raise InvalidMetadata("tensor_meta and names must be lists")
    if len(entries) != len(names) or len(names) > MAX_TENSORS:
        raise InvalidMetadata(f"{len(entries)} tensors described, {len(names)} names (at most {MAX_TENSORS})")
    if meta.tensor_device not in (*DEVICES, None):
        raise InvalidMetadata(f"device {meta.tensor_device!r} is not one of {DEVICES}")
    total, keys = 0, set()
    for i, (entry, name) in enumerate(zip(entries, names, strict=True)):
        if not isinstance(entry, tuple) or len(entry) != 2:
            raise InvalidMetadata(f"tensor {i}: not a (shape, dtype) pair")
        shape, dtype = entry
        if not isinstance(dtype, torch.dtype) or dtype not in SUPPORTED_DTYPES:
            raise InvalidMetadata(f"tensor {i}: dtype {dtype!r} is not one tensorwire carries")
        if not isinstance(shape, tuple) or len(shape) > LIMITS.max_ndim:
            raise InvalidMetadata(f"tensor {i}: shape {shape!r} is not a tuple of <= {LIMITS.max_ndim} dims")
        if any(type(d) is not int or d < 0 for d in shape):
            raise InvalidMetadata(f"tensor {i}: shape {shape!r} has a dimension that is not an int >= 0")
        total += math.prod(shape) * dtype.itemsize
        if total > max_object_bytes:
            raise InvalidMetadata(f"the object's tensors exceed max_object_bytes ({max_object_bytes} bytes)")
        if not isinstance(name, str) or NAME_RE.fullmatch(name) is None or name.rsplit("/", 1)[1] != str(i):
            raise InvalidMetadata(f"tensor {i}: name {name!r} is not one this transport gives")
        keys.add(name.split("/")[1])
    if len(keys) > 1:
        raise InvalidMetadata("the names belong to more than one object")
    if not names:
        return meta  # nothing to read: no store is asked
    for url, scheme in ((meta.shm_url, "shm"), (meta.tcp_url, "tcp")):
        address = _address(url)
        if address is None or address.scheme != scheme:
            raise InvalidMetadata(f"{scheme} URL {url!r} is not a {scheme}:// address")
    if not is_loopback(Address.parse(meta.shm_url).host):
        raise InvalidMetadata(f"shm URL {meta.shm_url!r} is not on loopback")
    if not isinstance(meta.node_id, str):
        raise InvalidMetadata("node_id is not a string")
    if Address.parse(meta.tcp_url).host != node_address(meta.node_id):
        raise InvalidMetadata(f"tcp URL {meta.tcp_url!r} is not the address of Ray node {meta.node_id!r}")
    return meta


def _address(url: object) -> Address | None:
    if not isinstance(url, str):
        return None
    try:
        return Address.parse(url)
    except (TensorwireError, ValueError):
        return None


__all__ = [
    "DEVICES", "LIMITS", "MAX_TENSORS", "NAME_RE", "PREFIX", "InvalidMetadata", "NodeAddress",
    "TensorwireCommunicatorMetadata", "TensorwireMetadata", "check_metadata",
]  # fmt: skip
