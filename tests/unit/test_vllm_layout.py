"""tensorwire.vllm's reference of a model (layout.py) read from safetensors headers, planted files
refused as LayoutMismatch, and the version record a trainer publishes (publisher.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tensorwire.errors import InvalidTensor, LayoutMismatch
from tensorwire.vllm import layout
from tensorwire.vllm.layout import MAX_HEADER_BYTES, MAX_VERSION_BYTES, from_checkpoint, key_of, read_header
from tensorwire.vllm.publisher import version_record


def checkpoint(folder: Path) -> Path:
    path = folder / "model.safetensors"
    tensors = {
        "embed.weight": torch.zeros(16, 8),
        "head.bias": torch.zeros(4, dtype=torch.bfloat16),
        "steps": torch.zeros((), dtype=torch.int64),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def planted(folder: Path, length: int, header: bytes) -> Path:
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", length) + header)
    return path


def test_read_header_gives_each_tensors_dtype_and_shape_without_its_data(tmp_path: Path) -> None:
    assert read_header(checkpoint(tmp_path)) == {
        "embed.weight": (torch.float32, (16, 8)),
        "head.bias": (torch.bfloat16, (4,)),
        "steps": (torch.int64, ()),
    }


def test_from_checkpoint_also_takes_the_models_dtype_for_floating_point_tensors(tmp_path: Path) -> None:
    checkpoint(tmp_path)
    reference = from_checkpoint(tmp_path, model_dtype=torch.bfloat16)
    assert reference.expected["embed.weight"].dtypes == {torch.float32, torch.bfloat16}
    assert reference.expected["steps"].dtypes == {torch.int64}  # not a float: its own dtype only
    assert reference.most_bytes == 16 * 8 * 4 + 4 * 2 + 8 + MAX_VERSION_BYTES


def test_a_folder_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LayoutMismatch, match=r"no \*\.safetensors"):
        from_checkpoint(tmp_path)


@pytest.mark.parametrize("length", [MAX_HEADER_BYTES + 1, 1 << 62, (1 << 64) - 1])
def test_a_planted_header_length_is_refused_before_it_is_read(tmp_path: Path, length: int) -> None:
    with pytest.raises(LayoutMismatch, match="a header of"):
        read_header(planted(tmp_path, length, b"{}"))


@pytest.mark.parametrize(
    "header",
    [
        b"\xff\xfe not json",
        b"{not json",
        b"[1, 2]",
        b'"a string"',
        b'{"x": {"dtype": "F32"}}',
        b'{"x": {"dtype": "F32", "shape": "16"}}',
        b'{"x": {"dtype": "F32", "shape": [-1]}}',
        b'{"x": {"dtype": "F32", "shape": [1.5]}}',
        b'{"x": {"dtype": "F32", "shape": [true]}}',
        b'{"x": {"dtype": "Q4", "shape": [1]}}',
        b'{"x": [1]}',
    ],
    ids=[
        "not-utf8", "not-json", "a-list", "a-string", "no-shape", "shape-a-string", "negative-dim",
        "float-dim", "bool-dim", "unknown-dtype", "entry-a-list",
    ],
)  # fmt: skip
def test_a_planted_header_is_refused_as_a_layout_mismatch(tmp_path: Path, header: bytes) -> None:
    with pytest.raises(LayoutMismatch):
        read_header(planted(tmp_path, len(header), header))


def test_a_file_shorter_than_its_header_length_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LayoutMismatch, match="cut short"):
        read_header(
            planted(tmp_path, 4096, json.dumps({"x": {"dtype": "F32", "shape": [1]}}).encode())
        )  # a whole JSON object, but cut short of the length it says
    (tmp_path / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(LayoutMismatch, match="no header length"):
        read_header(tmp_path / "model.safetensors")


def test_a_version_record_is_the_versions_bytes_padded() -> None:
    record = version_record("step-7 é")
    assert record.dtype == torch.uint8 and record.shape == (MAX_VERSION_BYTES,)
    assert bytes(record.numpy()).rstrip(b"\0").decode() == "step-7 é"
    assert bytes(version_record("v" * MAX_VERSION_BYTES).numpy()) == b"v" * MAX_VERSION_BYTES


@pytest.mark.parametrize(
    "version",
    ["", "v" * (MAX_VERSION_BYTES + 1), "é" * (MAX_VERSION_BYTES // 2 + 1), "step\x001"],
    ids=["empty", "over", "over-in-bytes-not-characters", "nul"],
)
def test_a_version_that_does_not_fit_its_record_is_refused(version: str) -> None:
    with pytest.raises(InvalidTensor):
        version_record(version)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("policy/embed.weight", "embed.weight"),
        ("policy/model/layers.0.q_proj", "model/layers.0.q_proj"),
        ("policy/@version", "@version"),
        ("policyx/embed.weight", "policyx/embed.weight"),  # another prefix that starts alike
        ("evil/embed.weight", "evil/embed.weight"),
        ("policy", "policy"),
    ],
)
def test_key_of_strips_only_its_own_prefix(name: str, key: str) -> None:
    assert key_of("policy", name) == key


def test_from_tensors_takes_each_tensors_own_dtype_and_shape() -> None:
    reference = layout.from_tensors([("w", torch.zeros(2, 3, dtype=torch.float16))], "a test")
    assert reference.expected["w"].shape == (2, 3) and reference.expected["w"].dtypes == {torch.float16}
    assert reference.most_bytes == 12 + MAX_VERSION_BYTES
