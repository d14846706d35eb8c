"""``ShardDataset``: a ``torch.utils.data.Dataset`` over the shards of a data set one node holds."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tensorwire.client.core import ClientOptions
from tensorwire.dataset.reader import LocalShards


class ShardDataset(Dataset[Any]):
    """The samples of a node's shards, in shard order, each read and checked on first use.

    ``source`` is the node's server (``tcp://127.0.0.1:7070``) or its ``--data-dir``. For a data
    set scattered ``--by files``, item i is ``(relative path, uint8 tensor of the file's bytes)``;
    ``--by rows``, it is a tuple with row i of each tensor, in ``keys`` order (as a
    ``TensorDataset``). ``transform`` maps that item to what the dataset returns. Rows are read a
    block at a time and the last block of each tensor is kept, so sequential reads cost one
    request per block. In a ``DataLoader`` with workers, each worker opens its own connection.
    """

    def __init__(
        self,
        source: str | Path,
        dataset: str | None = None,
        *,
        transform: Callable[[Any], Any] | None = None,
        options: ClientOptions | None = None,
    ) -> None:
        self.shards = LocalShards(source, dataset, options)
        self.dataset = self.shards.dataset
        self.by = self.shards.by
        self.keys = self.shards.keys
        self.transform = transform
        self.items = [item for shard in self.shards.shards for item in shard.items]
        self._blocks: dict[str, list[dict[str, Any]]] = {key: [] for key in self.keys}
        self._offsets: dict[str, list[int]] = {key: [] for key in self.keys}
        rows = dict.fromkeys(self.keys, 0)
        for item in self.items if self.by == "rows" else ():  # rows of all local shards, one after another
            key = item["key"]
            self._offsets[key].append(rows[key])
            self._blocks[key].append(item)
            rows[key] += item["stop"] - item["start"]
        self._rows = rows[self.keys[0]] if self.by == "rows" and self.keys else 0
        self._cache: dict[str, tuple[int, torch.Tensor]] = {}

    def close(self) -> None:
        """Close the connection to the node's server (if reading from one)."""
        self.shards.close()

    def __enter__(self) -> ShardDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return self._rows if self.by == "rows" else len(self.items)

    def __getitem__(self, index: int) -> Any:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        index %= len(self)
        if self.by == "rows":
            sample: Any = tuple(self._row(key, index) for key in self.keys)
        else:
            item = self.items[index]
            sample = (item["path"], self.shards.read(item))
        return self.transform(sample) if self.transform else sample

    def _row(self, key: str, index: int) -> torch.Tensor:
        b = bisect.bisect_right(self._offsets[key], index) - 1
        cached = self._cache.get(key)
        if cached is None or cached[0] != b:
            cached = self._cache[key] = (b, self.shards.read(self._blocks[key][b]))
        return cached[1][index - self._offsets[key][b]]
