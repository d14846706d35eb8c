"""DataDir: safetensors-compatible files, atomic batches, crash recovery, corrupt files."""

from __future__ import annotations

import json
import os
import pathlib
import re
import struct
from collections.abc import Callable

import pytest
import safetensors.torch
import torch

from tensorwire.errors import InvalidTensor, PersistenceError
from tensorwire.store.persist import DataDir
from tensorwire.store.revision import SLOTS_FILE
from tensorwire.store.tensor_file import encode_header, file_name
from tensorwire.types import TensorMeta
from tensorwire.wire.dtypes import SUPPORTED_DTYPES

NAMES = ["plain", "layer/0/weight", "ünïcödé/名前/🙂", "a b/../c"]


class Crash(BaseException):
    """Stands for the process dying: no ``except Exception`` in the code under test catches it."""


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def item(name: str, tensor: torch.Tensor, version: int) -> tuple[TensorMeta, memoryview]:
    meta = TensorMeta.of(name, tensor).with_version(version)
    return meta, memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def loaded(d: DataDir) -> dict[str, tuple[TensorMeta, bytes]]:
    out: dict[str, tuple[TensorMeta, bytes]] = {}
    for meta, data in d.load():
        assert data.dtype == torch.uint8
        assert data.dim() == 1
        assert data.numel() == meta.nbytes
        out[meta.name] = (meta, data.numpy().tobytes())
    return out


def leftovers(path: pathlib.Path) -> list[str]:
    """Files besides the tensors and the revision record (made once, when the directory opens)."""
    names = (p.name for p in path.iterdir())
    return sorted(n for n in names if not n.endswith(".safetensors") and n != SLOTS_FILE)


# ------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0, 3), (7,), (2, 3, 4)], ids=str)
def test_round_trip_every_dtype(tmp_path: pathlib.Path, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensors = {name: make_tensor(dtype, shape, seed=i) for i, name in enumerate(NAMES)}
    DataDir(tmp_path).write([item(n, t, 10 + i) for i, (n, t) in enumerate(tensors.items())])
    got = loaded(DataDir(tmp_path))
    assert set(got) == set(NAMES)
    for i, (name, tensor) in enumerate(tensors.items()):
        meta, data = got[name]
        assert meta == TensorMeta(name, dtype, shape, tensor.numel() * tensor.element_size(), 10 + i)
        assert data == raw_bytes(tensor)
    assert leftovers(tmp_path) == []


def test_file_layout(tmp_path: pathlib.Path) -> None:
    name = "dir/ünï"
    DataDir(tmp_path).write([item(name, make_tensor(torch.float32, (3,)), 5)])
    files = [f for f in tmp_path.iterdir() if f.name != SLOTS_FILE]
    assert [f.name for f in files] == [file_name(name)]
    assert len(file_name(name)) == 64 + len(".safetensors")
    blob = files[0].read_bytes()
    (hlen,) = struct.unpack("<Q", blob[:8])
    assert hlen % 8 == 0
    header = json.loads(blob[8 : 8 + hlen])
    assert header["__metadata__"] == {
        "tensorwire.version": "5",
        "tensorwire.dtype": "float32",
        "tensorwire.shape": "[3]",
    }
    assert header[name] == {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}
    assert len(blob) == 8 + hlen + 12


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("shape", [(), (0, 3), (4, 5)], ids=str)
def test_safetensors_library_reads_our_files(
    tmp_path: pathlib.Path, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    if dtype == torch.bool:
        tensor = torch.randint(0, 2, shape, dtype=torch.uint8).bool()  # only 0/1 bytes are real bools
    else:
        tensor = make_tensor(dtype, shape)
    DataDir(tmp_path).write([item("model/w", tensor, 1)])
    got = safetensors.torch.load_file(tmp_path / file_name("model/w"))
    assert list(got) == ["model/w"]
    assert got["model/w"].dtype == dtype
    assert got["model/w"].shape == tensor.shape
    assert raw_bytes(got["model/w"]) == raw_bytes(tensor)


def test_dtype_without_safetensors_code_is_stored_as_u8(tmp_path: pathlib.Path) -> None:
    tensor = make_tensor(torch.complex128, (2, 3))
    DataDir(tmp_path).write([item("c", tensor, 1)])
    got = safetensors.torch.load_file(tmp_path / file_name("c"))["c"]
    assert got.dtype == torch.uint8
    assert got.shape == (96,)
    assert raw_bytes(got) == raw_bytes(tensor)


def test_overwrite_keeps_only_new_version(tmp_path: pathlib.Path) -> None:
    d = DataDir(tmp_path)
    d.write([item("k", make_tensor(torch.float32, (4,), seed=1), 1)])
    new = make_tensor(torch.int16, (2, 2), seed=2)
    d.write([item("k", new, 2)])
    got = loaded(DataDir(tmp_path))
    assert list(got) == ["k"]
    assert got["k"][0].version == 2
    assert got["k"][0].dtype == torch.int16
    assert got["k"][1] == raw_bytes(new)


def test_remove(tmp_path: pathlib.Path) -> None:
    d = DataDir(tmp_path)
    d.write([item(n, make_tensor(torch.float32, (2,)), 1) for n in ["a", "b/c", "d"]])
    d.remove(["a", "b/c", "never-stored"])
    assert list(loaded(DataDir(tmp_path))) == ["d"]
    d.remove([])
    d.write([])
    assert list(loaded(DataDir(tmp_path))) == ["d"]


def test_non_safetensors_files_are_ignored(tmp_path: pathlib.Path) -> None:
    (tmp_path / "README.txt").write_text("hello")
    DataDir(tmp_path).write([item("x", make_tensor(torch.uint8, (3,)), 1)])
    assert list(loaded(DataDir(tmp_path))) == ["x"]
    assert (tmp_path / "README.txt").exists()


def test_creates_missing_directory(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "a" / "b"
    DataDir(path).write([item("x", make_tensor(torch.uint8, (3,)), 1)])
    assert list(loaded(DataDir(path))) == ["x"]


# ---------------------------------------------------------------------------------- bad input / OS


def test_write_refuses_inconsistent_items_before_touching_disk(tmp_path: pathlib.Path) -> None:
    d = DataDir(tmp_path)
    good = item("good", make_tensor(torch.float32, (2,)), 1)
    meta, data = item("bad", make_tensor(torch.float32, (2,)), 1)
    with pytest.raises(InvalidTensor):
        d.write([good, (meta, data[:4])])
    with pytest.raises(InvalidTensor):
        d.write([good, (TensorMeta("__metadata__", torch.uint8, (1,), 1, 1), memoryview(b"x"))])
    with pytest.raises(InvalidTensor):
        d.write([(TensorMeta("q", torch.qint8, (1,), 1, 1), memoryview(b"x"))])
    assert leftovers(tmp_path) == [] and not list(tmp_path.glob("*.safetensors"))


def test_os_errors_become_persistence_errors(tmp_path: pathlib.Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(PersistenceError, match="file"):
        DataDir(not_a_dir)
    d = DataDir(tmp_path / "gone")
    (tmp_path / "gone" / SLOTS_FILE).unlink()
    (tmp_path / "gone").rmdir()
    with pytest.raises(PersistenceError, match="gone"):
        d.write([item("x", make_tensor(torch.uint8, (3,)), 1)])
    with pytest.raises(PersistenceError, match="gone"):
        list(d.load())


# ---------------------------------------------------------------------------------------- crashes


def old_and_new(tmp_path: pathlib.Path) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Store three tensors at version 1; return the names and the version-2 values of a batch."""
    names = ["a", "b/x", "c/ü"]
    DataDir(tmp_path).write(
        [item(n, make_tensor(torch.float32, (5,), seed=i), 1) for i, n in enumerate(names)]
    )
    new = {n: make_tensor(torch.int32, (2, 2), seed=10 + i) for i, n in enumerate(names)}
    return names, new


def crash_on_call(monkeypatch: pytest.MonkeyPatch, name: str, after: int) -> None:
    """Make ``os.<name>`` kill the "process" on its call number ``after + 1``."""
    real: Callable[..., object] = getattr(os, name)
    calls = 0

    def fake(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls > after:
            raise Crash
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, fake)


@pytest.mark.parametrize(
    ("call", "after"),
    [
        # os.replace call 1 publishes the journal, calls 2-4 rename the three tensors' temps.
        pytest.param("replace", 1, id="no-rename-done"),
        pytest.param("replace", 2, id="one-rename-done"),
        pytest.param("replace", 3, id="two-renames-done"),
        # fsync calls 1-3: temps, 4: journal temp, 5: directory after the journal, 6: after renames.
        pytest.param("fsync", 5, id="all-renames-done"),
    ],
)
def test_crash_after_journal_completes_batch(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, call: str, after: int
) -> None:
    names, new = old_and_new(tmp_path)
    crash_on_call(monkeypatch, call, after=after)
    with pytest.raises(Crash):
        DataDir(tmp_path).write([item(n, new[n], 2) for n in names])
    monkeypatch.undo()
    assert any(n.startswith("journal-") for n in leftovers(tmp_path))
    got = loaded(DataDir(tmp_path))
    assert {n: (m.version, b) for n, (m, b) in got.items()} == {n: (2, raw_bytes(new[n])) for n in names}
    assert leftovers(tmp_path) == []


def test_crash_during_recovery_is_recovered_again(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names, new = old_and_new(tmp_path)
    crash_on_call(monkeypatch, "replace", after=1)
    with pytest.raises(Crash):
        DataDir(tmp_path).write([item(n, new[n], 2) for n in names])
    monkeypatch.undo()
    crash_on_call(monkeypatch, "replace", after=2)  # the replay dies after two of three renames
    with pytest.raises(Crash):
        DataDir(tmp_path)
    monkeypatch.undo()
    got = loaded(DataDir(tmp_path))
    assert {n: m.version for n, (m, _) in got.items()} == dict.fromkeys(names, 2)


@pytest.mark.parametrize("fsyncs_done", [0, 2, 3])
def test_crash_before_journal_keeps_old_values(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, fsyncs_done: int
) -> None:
    names, new = old_and_new(tmp_path)
    before = loaded(DataDir(tmp_path))
    # fsync calls 1-3 are the tensors' temps, call 4 the journal's temp: crashing at any of them
    # leaves temps but no journal.
    crash_on_call(monkeypatch, "fsync", after=fsyncs_done)
    with pytest.raises(Crash):
        DataDir(tmp_path).write([item(n, new[n], 2) for n in names])
    monkeypatch.undo()
    assert any(n.startswith(".tmp-") for n in leftovers(tmp_path))
    assert loaded(DataDir(tmp_path)) == before
    assert leftovers(tmp_path) == []


def test_crash_with_hand_made_temps_keeps_old_values(tmp_path: pathlib.Path) -> None:
    names, new = old_and_new(tmp_path)
    before = loaded(DataDir(tmp_path))
    for n in names:  # complete new files, but under temp names and with no journal: never committed
        meta, data = item(n, new[n], 2)
        (tmp_path / f".tmp-{n.encode().hex()}").write_bytes(encode_header(meta) + bytes(data))
    (tmp_path / ".tmp-torn").write_bytes(b"\x10\x00")
    assert loaded(DataDir(tmp_path)) == before
    assert leftovers(tmp_path) == []


def test_single_item_crash_before_rename_keeps_old_value(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _names, new = old_and_new(tmp_path)
    before = loaded(DataDir(tmp_path))
    crash_on_call(monkeypatch, "replace", after=0)
    with pytest.raises(Crash):
        DataDir(tmp_path).write([item("a", new["a"], 2)])
    monkeypatch.undo()
    assert loaded(DataDir(tmp_path)) == before
    assert leftovers(tmp_path) == []


def test_failed_rename_is_finished_before_next_write(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journal left by a failed rename must never be replayed over a newer value."""
    names, new = old_and_new(tmp_path)
    d = DataDir(tmp_path)
    real = os.replace
    calls = 0

    def flaky(src: object, dst: object) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(28, "No space left on device")
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", flaky)
    with pytest.raises(PersistenceError, match="No space left"):
        d.write([item(n, new[n], 2) for n in names])
    newest = make_tensor(torch.uint8, (1,), seed=99)
    d.write([item("b/x", newest, 3)])  # finishes the pending batch first, then writes version 3
    monkeypatch.undo()
    got = loaded(DataDir(tmp_path))
    assert {n: m.version for n, (m, _) in got.items()} == {"a": 2, "b/x": 3, "c/ü": 2}
    assert got["b/x"][1] == raw_bytes(newest)
    assert leftovers(tmp_path) == []


def test_failed_temp_write_leaves_nothing(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    names, new = old_and_new(tmp_path)
    before = loaded(DataDir(tmp_path))
    d = DataDir(tmp_path)
    real = os.fsync
    calls = 0

    def flaky(fd: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", flaky)
    with pytest.raises(PersistenceError, match="Input/output error"):
        d.write([item(n, new[n], 2) for n in names])
    monkeypatch.undo()
    assert leftovers(tmp_path) == []
    assert loaded(DataDir(tmp_path)) == before


def test_corrupt_journal_is_reported(tmp_path: pathlib.Path) -> None:
    (tmp_path / "journal-x.json").write_text('{"renames": [["../evil", "x.safetensors"]]}')
    with pytest.raises(PersistenceError, match=re.escape("journal-x.json")):
        DataDir(tmp_path)
    (tmp_path / "journal-x.json").write_text("{not json")
    with pytest.raises(PersistenceError, match=re.escape("journal-x.json")):
        DataDir(tmp_path)


# ---------------------------------------------------------------------------------- corrupt files


def stored_file(tmp_path: pathlib.Path) -> pathlib.Path:
    DataDir(tmp_path).write([item("w", make_tensor(torch.float32, (16,)), 1)])
    return tmp_path / file_name("w")


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b[:-1], id="truncated-data"),
        pytest.param(lambda b: b[:20], id="truncated-header"),
        pytest.param(lambda b: b[:4], id="truncated-length"),
        pytest.param(lambda b: b"", id="empty"),
        pytest.param(lambda b: b[:8] + b"\xff" * (len(b) - 8), id="garbage-header"),
        pytest.param(lambda b: struct.pack("<Q", 1 << 40) + b[8:], id="huge-length"),
        pytest.param(lambda b: b + b"extra", id="trailing-bytes"),
    ],
)
def test_corrupt_file_raises(tmp_path: pathlib.Path, damage: Callable[[bytes], bytes]) -> None:
    path = stored_file(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(PersistenceError, match=re.escape(path.name)):
        list(DataDir(tmp_path).load())


def test_foreign_safetensors_file_raises(tmp_path: pathlib.Path) -> None:
    path = tmp_path / file_name("w")
    safetensors.torch.save_file({"w": torch.zeros(3)}, path)  # valid, but no tensorwire metadata
    with pytest.raises(PersistenceError, match="metadata"):
        list(DataDir(tmp_path).load())


def test_file_under_wrong_name_raises(tmp_path: pathlib.Path) -> None:
    path = stored_file(tmp_path)
    path.rename(tmp_path / file_name("other"))
    with pytest.raises(PersistenceError, match="holds tensor 'w'"):
        list(DataDir(tmp_path).load())


def rewrite_metadata(path: pathlib.Path, **changes: str) -> None:
    blob = path.read_bytes()
    (hlen,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + hlen])
    header["__metadata__"].update(changes)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + hlen :])


@pytest.mark.parametrize(
    "changes",
    [
        {"tensorwire.version": "x"},
        {"tensorwire.version": "-1"},
        {"tensorwire.dtype": "qint8"},
        {"tensorwire.dtype": "float64"},
        {"tensorwire.shape": "[4, 5]"},
        {"tensorwire.shape": "[-16]"},
        {"tensorwire.shape": "oops"},
    ],
    ids=str,
)
def test_inconsistent_metadata_raises(tmp_path: pathlib.Path, changes: dict[str, str]) -> None:
    path = stored_file(tmp_path)
    rewrite_metadata(path, **changes)
    with pytest.raises(PersistenceError, match=re.escape(path.name)):
        list(DataDir(tmp_path).load())
