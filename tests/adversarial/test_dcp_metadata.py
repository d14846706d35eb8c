"""A hostile DCP checkpoint in a tensorwire store (a generation another job or a forged rank
published under a checkpoint's prefix) is refused by ``tensorwire.dcp.StorageReader`` before DCP
fills any tensor: chunks that overlap, leave a gap or lie past their tensor, sizes and dtypes that
do not match what is stored, keys naming tensors nobody wrote, tensors the metadata does not name,
another checkpoint's metadata, metadata that is not JSON (a pickle whose load would run code: never
loaded), byte items that only a full unpickler would load (never handed to DCP's planner, whose
``load_bytes`` is ``torch.load(weights_only=False)``). Each generation is published whole by this
test (``client.publish``), as anyone holding the server's token can; the checkpoint's other
tensor (``g``) would be read by the same load and stays untouched, so nothing was read. Each case
fails with its check removed from tensorwire/dcp/ (the load goes ahead and fills stale or foreign
bytes, or the pickle runs)."""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tensorwire
from tensorwire.dcp import StorageReader
from tensorwire.dcp.metadata import FORMAT
from tensorwire.server.options import ServerOptions

TOKEN = "adversarial-dcp"
SENTINEL = -7.0
W = torch.arange(16, dtype=torch.float32).reshape(4, 4)
G = torch.arange(3, dtype=torch.float32) + 100


def _doc(checkpoint_id: str, **changes: Any) -> dict[str, Any]:
    """Metadata of a 3-part save (ranks 0 and 1, then the metadata): ``w`` in two halves written
    by the two ranks, ``g`` whole by rank 0; ``changes`` replace top-level fields."""
    doc: dict[str, Any] = {
        "format": FORMAT, "checkpoint_id": checkpoint_id, "save_id": "s", "modules": [],
        "version": "1.0.0", "parts": 3, "planner_data": None, "bytes": {},
        "tensors": {
            "w": {"dtype": "float32", "size": [4, 4], "chunks": [
                {"offsets": [0, 0], "sizes": [2, 4], "key": "r0/0"},
                {"offsets": [2, 0], "sizes": [2, 4], "key": "r1/0"},
            ]},
            "g": {"dtype": "float32", "size": [3], "chunks": [{"offsets": [0], "sizes": [3], "key": "r0/1"}]},
        },
    }  # fmt: skip
    doc.update(changes)
    return doc


def _stored() -> dict[str, torch.Tensor]:
    return {"r0/0": W[:2].clone(), "r1/0": W[2:].clone(), "r0/1": G.clone()}


def _chunks(doc: dict[str, Any], *chunks: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    doc["tensors"]["w"]["chunks"] = list(chunks)
    return doc


def _chunk(offsets: list[int], sizes: list[int], key: str) -> dict[str, Any]:
    return {"offsets": offsets, "sizes": sizes, "key": key}


class _Boom:
    """Unpickling it would create ``path`` (what a real attack would run instead)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


@pytest.fixture
def server() -> Iterator[tensorwire.ServerThread]:
    with tensorwire.ServerThread(["tcp://127.0.0.1:0"], ServerOptions(token=TOKEN),
                                 store=tensorwire.TensorStore(64 << 20)) as srv:  # fmt: skip
        yield srv


def _publish(url: str, checkpoint_id: str, doc: bytes, tensors: dict[str, torch.Tensor]) -> None:
    with tensorwire.connect(url, token=TOKEN) as client:
        meta = torch.frombuffer(bytearray(doc), dtype=torch.uint8)
        client.publish(f"dcp/{checkpoint_id}", {"_metadata": meta, **tensors})


def _load(url: str, checkpoint_id: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {
        "w": torch.full((4, 4), SENTINEL),
        "g": torch.full((3,), SENTINEL),
        **(extra or {}),
    }
    with StorageReader(url, checkpoint_id, token=TOKEN) as reader:
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _refused(url: str, checkpoint_id: str, match: str, extra: dict[str, Any] | None = None) -> None:
    state: dict[str, Any] = {
        "w": torch.full((4, 4), SENTINEL),
        "g": torch.full((3,), SENTINEL),
        **(extra or {}),
    }
    with (
        StorageReader(url, checkpoint_id, token=TOKEN) as reader,
        pytest.raises(CheckpointException) as caught,
    ):
        dcp.load(state, storage_reader=reader, no_dist=True)
    # DCP raises what read_metadata raised as CheckpointException (its text inside an
    # AssertionError of DCP's when the metadata read failed): the refusal's words reach the caller
    errors = [exc for exc, _ in caught.value.failures.values()]
    assert any(match in str(e) for e in errors), errors
    assert bool((state["w"] == SENTINEL).all()) and bool((state["g"] == SENTINEL).all())  # nothing filled


def test_the_forged_generations_are_well_formed_when_not_tampered_with(
    server: tensorwire.ServerThread,
) -> None:
    """The baseline every case below changes one thing of: it loads, bit for bit."""
    _publish(server.url, "ok", json.dumps(_doc("ok")).encode(), _stored())
    state = _load(server.url, "ok")
    assert torch.equal(state["w"], W) and torch.equal(state["g"], G)


CASES: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor], str]] = {
    "overlapping chunks": (
        _chunks(_doc("c"), _chunk([0, 0], [3, 4], "r0/0"), _chunk([2, 0], [2, 4], "r1/0")),
        {"r0/0": W[:3].clone(), "r1/0": W[2:].clone(), "r0/1": G.clone()},
        "overlap",
    ),
    "a chunk past its tensor": (
        _chunks(_doc("c"), _chunk([0, 0], [2, 4], "r0/0"), _chunk([3, 0], [2, 4], "r1/0")),
        _stored(),
        "outside",
    ),
    "a gap nobody wrote": (
        _chunks(_doc("c"), _chunk([0, 0], [2, 4], "r0/0")),
        {"r0/0": W[:2].clone(), "r0/1": G.clone()},
        "cover",
    ),
    "a size that lies about the stored chunk": (
        _doc("c"),
        {**_stored(), "r1/0": W[2:3].clone()},
        "stored as",
    ),
    "a dtype that lies about the stored chunk": (
        _doc("c"),
        {**_stored(), "r1/0": W[2:].double()},
        "stored as",
    ),
    "a key no rank wrote": (
        _chunks(_doc("c"), _chunk([0, 0], [2, 4], "r0/0"), _chunk([2, 0], [2, 4], "r1/7")),
        _stored(),
        "no rank wrote",
    ),
    "a key of no data part": (
        _chunks(_doc("c"), _chunk([0, 0], [2, 4], "r0/0"), _chunk([2, 0], [2, 4], "r2/0")),
        {**_stored(), "r2/0": W[2:].clone()},
        "not the key",
    ),
    "two chunks in one stored tensor": (
        _chunks(_doc("c"), _chunk([0, 0], [2, 4], "r0/0"), _chunk([2, 0], [2, 4], "r0/0")),
        _stored(),
        "one stored tensor",
    ),
    "a tensor the metadata does not name": (
        _doc("c"),
        {**_stored(), "r1/1": torch.zeros(5)},
        "does not name",
    ),
    "another checkpoint's metadata": (_doc("other"), _stored(), "another job"),
    "not the format": (_doc("c", format="tensorwire.dcp/0"), _stored(), "format"),
    "absurd dimensions": (_chunks(_doc("c"), _chunk([0] * 40, [1] * 40, "r0/0")), _stored(), "at most"),
    "a negative size": (_chunks(_doc("c"), _chunk([0, 0], [-2, 4], "r0/0")), _stored(), "non-negative"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forged_metadata_is_refused_before_any_tensor_is_filled(
    server: tensorwire.ServerThread, case: str
) -> None:
    doc, tensors, match = CASES[case]
    _publish(server.url, "c", json.dumps(doc).encode(), tensors)
    _refused(server.url, "c", match)


def test_pickled_metadata_is_never_unpickled(server: tensorwire.ServerThread, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    _publish(server.url, "p", pickle.dumps(_Boom(marker)), _stored())
    _refused(server.url, "p", "not JSON")
    assert not marker.exists()


def test_a_byte_item_only_a_full_unpickler_loads_never_reaches_the_planner(
    server: tensorwire.ServerThread, tmp_path: Path
) -> None:
    """DCP's default planner loads byte items with torch.load(weights_only=False): the reader
    hands it only bytes that load with weights_only=True. A plain value still loads."""
    marker = tmp_path / "ran"
    evil = io.BytesIO()
    torch.save(_Boom(marker), evil)
    plain = io.BytesIO()
    torch.save({"step": 12, "lr": [0.5]}, plain)
    for checkpoint_id, blob in (("evil", evil.getvalue()), ("plain", plain.getvalue())):
        doc = _doc(checkpoint_id, bytes={"extra": {"key": "r1/1", "nbytes": len(blob)}})
        tensors = {**_stored(), "r1/1": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}
        _publish(server.url, checkpoint_id, json.dumps(doc).encode(), tensors)
    loaded = _load(server.url, "plain", {"extra": None})
    assert loaded["extra"] == {"step": 12, "lr": [0.5]}
    state: dict[str, Any] = {"w": torch.zeros(4, 4), "g": torch.zeros(3), "extra": None}
    with (
        StorageReader(server.url, "evil", token=TOKEN) as reader,
        pytest.raises(CheckpointException) as caught,
    ):
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert "weights_only=True" in str(caught.value)
    assert not marker.exists() and state["extra"] is None
