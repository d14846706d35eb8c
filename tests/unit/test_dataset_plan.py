"""How ``tensorwire.dataset.make_plan`` cuts a source into shards: deterministic, balanced, and
refusing what cannot be scattered with a clear error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tensorwire.dataset import make_plan
from tensorwire.errors import InvalidName, InvalidTensor


def test_files_are_dealt_by_size_and_named_under_their_shard(tmp_path: Path) -> None:
    sizes = [900, 800, 700, 300, 200, 100, 100, 0]
    for i, size in enumerate(sizes):
        (tmp_path / "set" / f"d{i % 2}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "set" / f"d{i % 2}" / f"f{i}").write_bytes(b"x" * size)
    plan = make_plan(tmp_path / "set", 3)
    loads = [shard.nbytes for shard in plan.shards]
    assert sum(loads) == sum(sizes) and max(loads) - min(loads) <= max(sizes)
    assert plan.shards[0].items[0].name.startswith("set/shard-00000/files/d")
    again = make_plan(tmp_path / "set", 3)  # a re-run computes the same items under the same names
    assert [[i.name for i in s.items] for s in again.shards] == [
        [i.name for i in s.items] for s in plan.shards
    ]


def test_rows_are_cut_into_contiguous_ranges_and_blocks(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((10, 4), dtype=np.float32))
    plan = make_plan(tmp_path / "x.npy", 3, "rows", "xs", block_bytes=48)  # 3 rows of 16 B a block
    ranges = [[(i.start, i.stop) for i in shard.items] for shard in plan.shards]
    assert ranges == [[(0, 3)], [(3, 6)], [(6, 9), (9, 10)]]
    assert plan.keys == ["x"] and plan.shards[2].items[1].name == "xs/shard-00002/rows/x/000000000009"


def test_sources_that_cannot_be_scattered_are_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.zeros((5, 2)))
    np.save(tmp_path / "b.npy", np.zeros((6,)))
    with pytest.raises(InvalidTensor, match="same first dimension"):
        make_plan(tmp_path, 2, "rows")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tab\there").write_bytes(b"1")
    with pytest.raises(InvalidName, match="cannot be named"):
        make_plan(tmp_path / "bad", 2)
    with pytest.raises(FileNotFoundError):
        make_plan(tmp_path / "missing", 2)
