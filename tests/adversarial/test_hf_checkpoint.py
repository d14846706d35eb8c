"""A safetensors checkpoint is someone else's files: ``tensorwire.hf.open_checkpoint`` (behind
``publish_checkpoint`` and ``tensorwire put --generation``) reads only shards that are plain files
of the index's own folder, refuses an index that names a tensor twice or disagrees with its
shards, and lets safetensors refuse a header whose sizes lie. Every refusal is InvalidTensor
naming the file, and nothing is published.

The escapes are aimed at real, valid safetensors files outside the folder, so that a missing check
shows as a checkpoint read (and published) from where it must not be."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from click.testing import CliRunner

import tensorwire
import tensorwire.hf
from tensorwire import cli
from tensorwire.errors import InvalidTensor, KeyNotFound
from tensorwire.hf import SAFE_WEIGHTS_INDEX_NAME, open_checkpoint
from tensorwire.server import ServerOptions

TOKEN = "hf-checkpoint-token"


def checkpoint(root: Path, weight_map: dict[str, str] | str) -> Path:
    """A folder ``root/ckpt`` with a valid shard ``a.safetensors`` (tensor "a"), a valid file
    ``root/outside.safetensors`` (tensor "b") beside it, and an index mapping as given."""
    folder = root / "ckpt"
    folder.mkdir()
    safetensors.torch.save_file({"a": torch.ones(3)}, str(folder / "a.safetensors"))
    safetensors.torch.save_file({"b": torch.full((2,), 7.0)}, str(root / "outside.safetensors"))
    text = (
        weight_map if isinstance(weight_map, str) else json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (folder / SAFE_WEIGHTS_INDEX_NAME).write_text(text)
    return folder


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_a_shard_outside_the_folder_is_refused(tmp_path: Path, where: str) -> None:
    shard = str(tmp_path / "outside.safetensors") if where == "ABSOLUTE" else where
    folder = checkpoint(tmp_path, {"a": "a.safetensors", "b": shard})
    with pytest.raises(InvalidTensor, match="not a file of its folder"), open_checkpoint(folder):
        pass


def test_nothing_is_published_from_a_refused_checkpoint(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, {"a": "a.safetensors", "b": "../outside.safetensors"})
    options = ServerOptions(token=TOKEN)
    with tensorwire.ServerThread(
        ["tcp://127.0.0.1:0"], options, store=tensorwire.TensorStore(1 << 20)
    ) as srv:
        with pytest.raises(InvalidTensor, match=r"outside\.safetensors"):
            tensorwire.hf.publish_checkpoint(folder, srv.url, "ckpt", token=TOKEN)
        result = CliRunner(env={"TENSORWIRE_TOKEN": TOKEN}).invoke(
            cli.main, ["put", "--generation", "ckpt", str(folder), "--server", srv.url]
        )
        assert result.exit_code == 1 and "error:" in result.output and "Traceback" not in result.output
        with tensorwire.connect(srv.url, token=TOKEN) as client, pytest.raises(KeyNotFound):
            client.manifest("ckpt")


def test_a_name_given_twice_is_refused(tmp_path: Path) -> None:
    """json keeps the last of two equal keys: "a" would silently come from the second shard."""
    index = '{"weight_map": {"a": "a.safetensors", "a": "../outside.safetensors"}}'
    with pytest.raises(InvalidTensor, match="'a' twice"), open_checkpoint(checkpoint(tmp_path, index)):
        pass


def test_an_index_and_its_shards_must_agree(tmp_path: Path) -> None:
    folder = checkpoint(tmp_path, {"a": "a.safetensors", "c": "a.safetensors"})
    with pytest.raises(InvalidTensor, match=r"disagree.*'c'"), open_checkpoint(folder):
        pass
    other = tmp_path / "other"
    other.mkdir()
    safetensors.torch.save_file({"a": torch.ones(3), "z": torch.ones(1)}, str(other / "a.safetensors"))
    (other / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps({"weight_map": {"a": "a.safetensors"}}))
    with pytest.raises(InvalidTensor, match=r"disagree.*'z'"), open_checkpoint(other):
        pass


@pytest.mark.parametrize("index", ["[]", '{"weight_map": {}}', '{"weight_map": {"a": 3}}', "{", "\xff"])
def test_a_malformed_index_is_refused(tmp_path: Path, index: str) -> None:
    with pytest.raises(InvalidTensor), open_checkpoint(checkpoint(tmp_path, index)):
        pass


def lying(path: Path, header: dict[str, object], data: bytes, length: int | None = None) -> Path:
    """A safetensors file with ``header`` (8-byte little-endian length, JSON) over ``data``."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length"),
    [
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(8), None),  # 16 bytes as 8
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(4), None),  # past the end
        ({"a": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 8]}}, bytes(8), None),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), 1 << 40),  # header size
        (  # overlapping tensors
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            None,
        ),
    ],
    ids=["size", "past-end", "overflow", "header-length", "overlap"],
)
def test_a_header_with_lying_sizes_is_refused_by_safetensors(
    tmp_path: Path, header: dict[str, object], data: bytes, length: int | None
) -> None:
    file = lying(tmp_path / "model.safetensors", header, data, length)
    with (
        pytest.raises(InvalidTensor, match="not a readable safetensors file") as caught,
        open_checkpoint(file),
    ):
        pass
    assert isinstance(caught.value.__cause__, safetensors.SafetensorError)  # safetensors' own check
    # the honest file of the same shape opens:
    ok = lying(
        tmp_path / "ok.safetensors", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)
    )
    with open_checkpoint(ok) as tensors:
        assert torch.equal(tensors["a"], torch.zeros(2))
