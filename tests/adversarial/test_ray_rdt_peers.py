"""The tensorwire RDT transport (``tensorwire.ray.transport``) against peers that lie: a reader with
the wrong token, metadata forged to make a reader allocate or read what it should not, and a
client that holds the token but not an object's metadata. No Ray cluster: the sender's store and
the reader are the transport's own parts (``rdt_store.Sender``, ``transport._Reader``), on loopback,
in this process."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import tensorwire
from tensorwire.errors import AuthenticationError, KeyNotFound, NotAuthorized

pytest.importorskip("ray", reason="tensorwire.ray needs Ray: pip install 'tensorwire[ray]'")

from tensorwire.ray import rdt_store, transport

TOKEN = "the-clusters-token"
NODE = "node-a"
TIMEOUT = 10.0


def node_address(node_id: str) -> str | None:
    return "127.0.0.1" if node_id == NODE else None


class Sender:
    """One actor's side: its store (a real server on loopback) and an object in it."""

    def __init__(self) -> None:
        self.side = rdt_store.Sender(TOKEN, 1 << 30, "127.0.0.1", NODE)
        self.tensors = [torch.arange(16, dtype=torch.float32), torch.ones(100_000, dtype=torch.int64)]
        self.names = self.side.put("obj-1", self.tensors)
        self.meta = transport.TensorwireMetadata(
            tensor_meta=[(t.shape, t.dtype) for t in self.tensors],
            tensor_device="cpu",
            names=self.names,
            shm_url=self.side.shm_url,
            tcp_url=self.side.tcp_url,
            node_id=NODE,
        )


@pytest.fixture
def sender() -> Iterator[Sender]:
    s = Sender()
    try:
        yield s
    finally:
        s.side.server.close()


def reader(token: str = TOKEN, node_id: str = NODE) -> transport.TensorwireTransport:
    """A reader's transport, as Ray would make it in another process (here: no Ray)."""
    cls = type("Reader", (transport.TensorwireTransport,), {"token": token, "timeout": TIMEOUT})
    r = cls()
    r._reader = transport._Reader(token, TIMEOUT, node_id, node_address)
    return r


def close(r: transport.TensorwireTransport) -> None:
    assert r._reader is not None
    for client in r._reader.clients.values():
        client.close()


@pytest.fixture
def no_allocation(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every buffer a read allocates, refused: a forged read must be stopped before this."""
    made: list[tuple[Any, ...]] = []

    def refuse(shape: Any, dtype: Any) -> torch.Tensor:
        made.append((shape, dtype))
        raise AssertionError(f"allocated {shape} {dtype} for forged metadata")

    monkeypatch.setattr(transport, "empty_host", refuse)
    return made


def recv(r: transport.TensorwireTransport, meta: Any) -> list[Any]:
    return r.recv_multiple_tensors("obj-1", meta, transport.TensorwireCommunicatorMetadata())


@pytest.mark.parametrize("node_id", [NODE, "node-b"], ids=["shm", "tcp"])
def test_a_reader_with_a_wrong_token_is_refused(sender: Sender, node_id: str) -> None:
    good, bad = reader(node_id=node_id), reader("not-the-token", node_id=node_id)
    try:
        got = recv(good, sender.meta)  # the control: the right token reads it, bit-exact
        assert all(torch.equal(a, b) for a, b in zip(got, sender.tensors, strict=True))
        with pytest.raises(AuthenticationError):
            recv(bad, sender.meta)
        for url in (sender.side.shm_url, sender.side.tcp_url):  # and so is any other client
            with pytest.raises(AuthenticationError):
                tensorwire.connect(url, token="not-the-token", retries=0)
    finally:
        close(good)
        close(bad)


def forged(meta: transport.TensorwireMetadata, **changes: Any) -> transport.TensorwireMetadata:
    return dataclasses.replace(meta, **changes)


def one(shape: Any, dtype: Any) -> dict[str, Any]:
    """Tensor 0 described as ``shape`` of ``dtype`` (tensor 1 as it is)."""
    return {"tensor_meta": lambda m: [(shape, dtype), m.tensor_meta[1]]}


def field(name: str, value: Any) -> dict[str, Any]:
    return {name: value}


def url(name: str, old: str, new: str) -> dict[str, Any]:
    return {name: lambda m: getattr(m, name).replace(old, new)}


HUGE = (1 << 40,)  # 4 TiB of float32
STORED = "the store holds"  # refused by the store's STAT, once connected
NOT_CARRIED = "is not one tensorwire carries"
BAD_DIM = "has a dimension that is not an int >= 0"
NOT_SHAPE = "is not a tuple of"
NOT_OURS = "is not one this transport gives"
# Each forgery, and what the refusal names: the check that stops it before any buffer is allocated.
FORGERIES: dict[str, tuple[dict[str, Any], str]] = {
    "huge size": (one(HUGE, torch.float32), "max_object_bytes"),
    "huge in total": ({"tensor_meta": lambda m: [((1 << 34,), torch.float32)] * 2}, "max_object_bytes"),
    "bigger than stored": (one((1 << 20,), torch.float32), STORED),
    "other dtype than stored": (one((16,), torch.float64), STORED),
    "other shape than stored": (one((4, 4), torch.float32), STORED),
    "dtype a string": (one((16,), "float32"), NOT_CARRIED),
    "numpy dtype": (one((16,), np.dtype("float32")), NOT_CARRIED),
    "quantized dtype": (one((16,), torch.qint8), NOT_CARRIED),
    "negative dim": (one((-1,), torch.float32), BAD_DIM),
    "bool dim": (one((True,), torch.float32), BAD_DIM),
    "float dim": (one((16.0,), torch.float32), BAD_DIM),
    "too many dims": (one((1,) * 40, torch.float32), NOT_SHAPE),
    "shape a list": (one([16], torch.float32), NOT_SHAPE),
    "not a pair": (field("tensor_meta", lambda m: [((16,), torch.float32, 0), m.tensor_meta[1]]), "pair"),
    "more tensors than names": (field("tensor_meta", lambda m: [*m.tensor_meta] * 2), "4 tensors"),
    "another store's name": (field("names", lambda m: ["model/w", m.names[1]]), NOT_OURS),
    "two objects' names": (field("names", lambda m: [m.names[0], f"rdt/{'0' * 32}/1"]), "more than one"),
    "names out of order": (field("names", lambda m: m.names[::-1]), NOT_OURS),
    "shm not on loopback": (url("shm_url", "127.0.0.1", "192.0.2.9"), "not on loopback"),
    "tcp not at the node": (url("tcp_url", "127.0.0.1", "192.0.2.9"), "not the address of Ray node"),
    "tls instead of tcp": (url("tcp_url", "tcp://", "tls://"), "is not a tcp:// address"),
    "an unknown device": (field("tensor_device", lambda m: "meta"), "device 'meta'"),
}  # fmt: skip


@pytest.mark.parametrize("name", FORGERIES)
@pytest.mark.parametrize("node_id", [NODE, "node-b"], ids=["shm", "tcp"])
def test_forged_metadata_is_refused_before_anything_is_allocated(
    sender: Sender, no_allocation: list[tuple[Any, ...]], name: str, node_id: str
) -> None:
    changes, refusal = FORGERIES[name]
    meta = forged(sender.meta, **{k: f(sender.meta) for k, f in changes.items()})
    r = reader(node_id=node_id)
    try:
        with pytest.raises(transport.InvalidMetadata, match=refusal):
            recv(r, meta)
        assert no_allocation == []
    finally:
        close(r)


def test_a_true_object_over_the_readers_bound_is_refused_before_anything_is_allocated(
    sender: Sender, no_allocation: list[tuple[Any, ...]]
) -> None:
    """The store holds what the metadata says (800 KB): still more than this reader takes."""
    r = reader()
    r.max_object_bytes = 64 * 1024  # type: ignore[misc]
    try:
        with pytest.raises(transport.InvalidMetadata, match="max_object_bytes"):
            recv(r, sender.meta)
        assert no_allocation == []
    finally:
        close(r)


def test_an_objects_names_are_random_not_derived_from_its_id(sender: Sender) -> None:
    again = sender.side.put("obj-1", sender.tensors)  # the same id, put again (a retried task)
    other = Sender()
    try:
        keys = {names[0].split("/")[1] for names in (sender.names, again, other.names)}
        assert len(keys) == 3 and all(len(k) == 32 and int(k, 16) >= 0 for k in keys)
        assert sender.side.objects["obj-1"] == again  # the retry's copy replaced the first
        assert len(sender.side.store) == len(again)  # and the first copy is gone
    finally:
        other.side.server.close()


def test_metadata_of_another_type_is_refused(no_allocation: list[tuple[Any, ...]]) -> None:
    meta = transport.TensorTransportMetadata(tensor_meta=[((16,), torch.float32)], tensor_device="cpu")
    with pytest.raises(transport.InvalidMetadata, match="not TensorwireMetadata"):
        recv(reader(), meta)
    assert no_allocation == []


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_a_client_with_the_token_cannot_list_guess_overwrite_or_delete_an_object(
    sender: Sender, scheme: str
) -> None:
    url = sender.side.shm_url if scheme == "shm" else sender.side.tcp_url
    with tensorwire.connect(url, token=TOKEN, retries=0) as client:
        with pytest.raises(NotAuthorized):
            client.list("")  # the names are not listed, under any prefix
        with pytest.raises(NotAuthorized):
            client.list("rdt/")
        key = sender.names[0].split("/")[1]
        guess = f"rdt/{key[:-1]}{'0' if key[-1] != '0' else '1'}/0"  # one hex digit off
        with pytest.raises(KeyNotFound):
            client.get(guess)
        with pytest.raises(NotAuthorized):
            client.put(sender.names[0], torch.zeros(16))  # nor overwritten
        with pytest.raises(NotAuthorized):
            client.put(sender.names[1], torch.zeros(100_000, dtype=torch.int64))  # a segment's size
        with pytest.raises(NotAuthorized):
            client.delete(sender.names[0])  # nor deleted
        assert torch.equal(client.get(sender.names[0]), sender.tensors[0])  # intact


def test_a_reader_handed_a_guessed_name_finds_nothing(sender: Sender) -> None:
    key = "0" * 32  # well-formed, not the object's
    meta = forged(sender.meta, names=[f"rdt/{key}/0", f"rdt/{key}/1"])
    r = reader()
    try:
        with pytest.raises(transport.ObjectNotFound):
            recv(r, meta)
    finally:
        close(r)


def test_a_freed_object_cannot_be_read(sender: Sender) -> None:
    sender.side.free("obj-1")
    assert len(sender.side.store) == 0 and sender.side.store.stored == 0
    r = reader()
    try:
        with pytest.raises(transport.ObjectNotFound):
            recv(r, sender.meta)
    finally:
        close(r)
