"""Item 6: a DELETE frees space on a full disk; it never needs new disk space itself.

The first test fills a real (tmpfs) disk, which needs the right to mount: it skips where it has
not. The second makes every file creation in the data directory fail with ENOSPC at the OS call,
which is what a full disk does to a new file, and runs everywhere.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorwire
from tensorwire.errors import PersistenceError
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.types import KiB, MiB

TENSOR = torch.arange(64 * KiB, dtype=torch.int32)  # 256 KiB


@contextlib.contextmanager
def small_disk(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where``; skips the test if this process cannot mount."""
    where.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]
    done = subprocess.run(mount, check=False, capture_output=True, timeout=10)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True, timeout=10)


def fill(disk: Path) -> None:
    """Write a file until the disk has no block left."""
    block = bytes(4 * KiB)
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        while os.write(fd, block) == len(block):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    with pytest.raises(OSError):  # not even a small new file fits now
        (disk / "probe").write_bytes(b"x" * 4096)


def test_delete_frees_space_on_a_really_full_disk(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "2m") as disk:
        with ServerThread(store=TensorStore(64 * MiB, disk)) as srv, tensorwire.connect(srv.url) as c:
            newest = max(c.put(f"t/{i}", TENSOR) for i in range(3))
            fill(disk)
            with pytest.raises(PersistenceError):  # a put needs space: refused, as it must be
                c.put("t/more", TENSOR)
            c.delete("t/0")  # a delete does not: it frees space
            assert [m.name for m in c.list()] == ["t/1", "t/2"]
            assert c.put("t/more", TENSOR) > newest  # the freed space is usable at once
        again = TensorStore(64 * MiB, disk)  # the delete is durable, and versions are never reused
        assert sorted(m.name for m in again.list()) == ["t/1", "t/2", "t/more"]


def test_delete_needs_no_new_file_in_the_data_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every new file in the data directory fails with ENOSPC (as on a full disk); writes into
    files that exist do not. A delete must still work, and its revision must survive a restart."""
    data = tmp_path / "data"
    with ServerThread(store=TensorStore(64 * MiB, data)) as srv, tensorwire.connect(srv.url) as c:
        for i in range(3):
            c.put(f"t/{i}", TENSOR)
        newest = c.put("t/3", TENSOR)
        real_open = builtins.open

        def full_disk_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if any(flag in mode for flag in "xwa") and Path(file).parent == data:
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", full_disk_open)
        with pytest.raises(PersistenceError):
            c.put("t/more", TENSOR)
        c.delete("t/3")  # the newest version now lives in no file
        monkeypatch.undo()
    again = TensorStore(64 * MiB, data)
    assert sorted(m.name for m in again.list()) == ["t/0", "t/1", "t/2"]
    res = again.reserve([again.stat(["t/0"])[0].with_version(0)])
    assert again.commit(res) > newest  # a restart never hands out the deleted version again
