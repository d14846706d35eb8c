"""How ``tensorwire.dataset.make_plan`` cuts a source into shards: deterministic, stable, and
refusing what cannot be scattered with a clear error."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tensorwire.dataset import Plan, make_plan
from tensorwire.dataset.plan import assign_shard, plan_identity
from tensorwire.errors import InvalidName, InvalidTensor


def _folder(root: Path, names: list[str]) -> Path:
    for i, rel in enumerate(names):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * (i % 97))
    return root


def _where(plan: Plan) -> dict[str, int]:
    """Each file's shard in ``plan``."""
    return {str(item.path): shard.index for shard in plan.shards for item in shard.items}


def test_files_keep_their_shard_when_others_come_go_or_shards_are_added(tmp_path: Path) -> None:
    names = [f"class-{i % 10}/img {i:04d}.jpg" for i in range(1000)]
    src = _folder(tmp_path / "set", names)
    before = _where(make_plan(src, 8))
    counts = Counter(before.values())
    # Rendezvous hashing balances counts in expectation: 125 each, sigma ~10.5; within 3 sigma.
    assert sorted(counts) == list(range(8)) and max(abs(n - 125) for n in counts.values()) <= 32

    (src / "class-3" / "new.jpg").write_bytes(b"y" * 50_000)  # one file more: only it is placed
    added = _where(make_plan(src, 8))
    assert set(added) - set(before) == {"class-3/new.jpg"}
    assert {rel: added[rel] for rel in before} == before

    (src / names[500]).unlink()  # one file less: the others stay where they were
    removed = _where(make_plan(src, 8))
    assert removed == {rel: k for rel, k in added.items() if rel != names[500]}

    grown = _where(make_plan(src, 9))  # a ninth shard takes ~1/9 of the files, from all the others
    moved = {rel for rel in removed if grown[rel] != removed[rel]}
    assert all(grown[rel] == 8 for rel in moved)
    assert 1000 / 9 * 0.75 <= len(moved) <= 1000 / 9 * 1.25
    assert len({removed[rel] for rel in moved}) == 8


def test_files_are_named_under_their_shard_the_same_way_every_run(tmp_path: Path) -> None:
    src = _folder(tmp_path / "set", [f"d{i % 2}/f{i}" for i in range(8)])
    plan = make_plan(src, 3)
    assert sum(shard.nbytes for shard in plan.shards) == sum(i % 97 for i in range(8))
    for shard in plan.shards:
        names = [item.name for item in shard.items]
        assert names == sorted(names)
        assert all(n.startswith(f"set/shard-{shard.index:05d}/files/d") for n in names)
        assert all(assign_shard(str(item.path), 3) == shard.index for item in shard.items)
    again = make_plan(src, 3)  # a re-run computes the same items under the same names
    assert [[i.name for i in s.items] for s in again.shards] == [
        [i.name for i in s.items] for s in plan.shards
    ]
    # The same in every process and Python version: the hash is not salted.
    assert [assign_shard("a/b.txt", n) for n in (1, 2, 3, 5, 8)] == [0, 1, 1, 1, 6]


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


def test_a_plans_identity_is_its_tree_and_its_options(tmp_path: Path) -> None:
    """The same tree, planned again: the same identity (a re-run resumes). Another shard count,
    split, name, an edited or touched file, one file more: another (a scatter needs --replace)."""
    import os

    src = _folder(tmp_path / "set", [f"d{i % 2}/f{i}" for i in range(8)])
    ours = plan_identity(make_plan(src, 3))
    assert plan_identity(make_plan(src, 3)) == ours
    assert plan_identity(make_plan(src, 4)) != ours
    assert plan_identity(make_plan(src, 3, dataset="other")) != ours
    os.utime(src / "d0" / "f0", ns=(1, 1))  # same bytes, another modification time
    touched = plan_identity(make_plan(src, 3))
    assert touched != ours
    (src / "d1" / "new").write_bytes(b"")
    assert plan_identity(make_plan(src, 3)) not in (ours, touched)
