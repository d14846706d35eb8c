"""Where each parameter lives: a deterministic, load-balanced placement on S servers.

Why it looks the way it does:

* **Even load.** Every step each worker pushes a gradient for, and pulls, every byte of every
  parameter, so a server's traffic is proportional to the bytes it holds and the busiest server
  sets the step time. The plan keeps the largest load as close to the mean as it can;
  ``Placement.imbalance()`` reports max / mean (1.0 is perfect).
* **Contiguous ranges.** A shard is one range ``[start, stop)`` of a parameter's flattened
  elements, so a worker pulls it straight into ``param.data.view(-1)[start:stop]`` (and pushes
  ``grad.view(-1)[start:stop]``) without a gather or a copy.
* **Deterministic.** Every worker computes the same plan from the model alone, without talking to
  anyone: parameters are ordered by name (so dict order does not matter), every tie is broken by
  name or by server index, and all arithmetic is on integers.

The algorithm, in two passes:

1. *Small* parameters (``nbytes <= split_bytes``) stay whole: a shard costs a request, and a small
   tensor gains little balance from being cut. They are packed greedily, largest first (ties by
   name), each onto the least-loaded server (ties by lowest index).
2. *Large* parameters (``nbytes > split_bytes``) then fill the servers up to one common level
   ("water-filling"): server i takes ``max(0, level - load_i)`` bytes of them, the level chosen so
   those quotas add up to all the large bytes. Each large parameter is cut across every server
   with a quota, in proportion to the quotas, on element boundaries; so every server serves a
   piece of each large parameter and a worker pulls it from all of them at once.

Why small first: splitting the large tensors first spreads them evenly, and then the greedy
packing of the small ones leaves up to one small tensor of imbalance on top. Packing first and
letting the divisible tensors fill the gaps evens that out too: for a given packing, water-filling
reaches the lowest maximum load there is, so it is never worse. Example, 2 servers, small tensors
of 3 and 1 MiB, one large of 6 MiB: split first ends at 6 and 4 MiB (imbalance 1.2), small first
at 5 and 5 (1.0).

Edge cases: a server already above the level (only when one small tensor outweighs a fair share)
gets no piece of the large ones, as its piece would be empty. A large tensor with fewer elements
than servers is cut into at most its element count. A parameter with no elements gets one empty
shard ``[0, 0)``, the only empty shard there is, so that every parameter has a home.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tensorwire.types import GiB, KiB, MiB
from tensorwire.wire.dtypes import dtype_from_name, dtype_name

DEFAULT_SPLIT_BYTES = 4 * MiB
_JSON_FORMAT = "tensorwire.placement"
_JSON_VERSION = 1


@dataclass(frozen=True)
class ParamSpec:
    """What placement needs to know of one parameter: its name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        # A torch.Size or a list would compare equal to the tuple but not survive JSON as itself.
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if any(d < 0 for d in self.shape):
            raise ValueError(f"parameter {self.name!r} has a negative dimension in {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @staticmethod
    def of(module: torch.nn.Module) -> list[ParamSpec]:
        """The trainable parameters of ``module``, in ``named_parameters()`` order.

        Frozen parameters (``requires_grad=False``) never get a gradient to push, so they are left
        out; a tied parameter appears once. Only shapes and dtypes are read, so a module built on
        the ``meta`` device works: a model can be planned on a machine that could not hold it.
        """
        return [
            ParamSpec(n, tuple(p.shape), p.dtype) for n, p in module.named_parameters() if p.requires_grad
        ]

    @staticmethod
    def from_tensors(tensors: Mapping[str, torch.Tensor]) -> list[ParamSpec]:
        """One spec per entry of a ``state_dict``-like mapping, in the mapping's order."""
        return [ParamSpec(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


@dataclass(frozen=True)
class Shard:
    """Elements ``[start, stop)`` of parameter ``param``, flattened, held by server ``server``."""

    param: str
    server: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def key(self) -> str:
        """The store key of this shard, ``f"{param}#{start}:{stop}"``, e.g. ``"fc.weight#0:4096"``.

        The range is part of the key even for a whole parameter, so a shard stored under a plan
        with other boundaries is never read as a shard of this one. A name may itself contain
        "#": split a key with ``rpartition("#")``.
        """
        return f"{self.param}#{self.start}:{self.stop}"


@dataclass(frozen=True)
class Placement:
    """Which server holds which range of which parameter. Checked when built; see `plan`.

    Every element of every parameter is in exactly one shard, and the shards of a parameter are
    contiguous; a Placement that breaks this (say, from a hand-edited JSON file) raises ValueError.
    `plan` sorts ``params`` by name and ``shards`` by (param, start), so equal plans are equal
    objects with equal JSON.
    """

    servers: int
    params: tuple[ParamSpec, ...]
    shards: tuple[Shard, ...]
    _specs: dict[str, ParamSpec] = field(init=False, repr=False, compare=False)
    _by_param: dict[str, tuple[Shard, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"a placement needs at least one server, got {self.servers}")
        object.__setattr__(self, "_specs", _by_name(self.params))
        object.__setattr__(self, "_by_param", _index(self.servers, self.params, self.shards))

    def spec(self, param: str) -> ParamSpec:
        """The spec of ``param``; KeyError if the placement does not know it."""
        return self._specs[param]

    def shards_of(self, param: str) -> tuple[Shard, ...]:
        """The shards of ``param`` in element order; KeyError if the placement does not know it."""
        return self._by_param[param]

    def on_server(self, server: int) -> tuple[Shard, ...]:
        """The shards held by ``server``, by parameter name and then element order."""
        if not 0 <= server < self.servers:
            raise ValueError(f"server {server} is not one of the {self.servers} servers")
        return tuple(s for s in self.shards if s.server == server)

    def load(self) -> list[int]:
        """Bytes held by each server, indexed by server."""
        loads = [0] * self.servers
        for shard in self.shards:
            loads[shard.server] += self._nbytes(shard)
        return loads

    def imbalance(self) -> float:
        """Largest load over mean load: 1.0 is even, 2.0 means one server carries twice its share.

        A placement of no bytes at all is even (1.0): no server waits for another.
        """
        loads = self.load()
        total = sum(loads)
        return max(loads) * self.servers / total if total else 1.0

    def describe(self) -> str:
        """A table for people: per server its shards and load, then the imbalance."""
        loads = self.load()
        total = sum(loads)
        name_w = max((len(s.param) for s in self.shards), default=0)
        range_w = max((len(self._range(s)) for s in self.shards), default=0)
        params, servers = _count(len(self.params), "parameter"), _count(self.servers, "server")
        lines = [f"{params}, {_human(total)}, on {servers}"]
        for server, load in enumerate(loads):
            share = 100 * load / total if total else 0.0
            mine = self.on_server(server)
            shards = _count(len(mine), "shard")
            lines.append(f"server {server}: {load:,} bytes ({_human(load)}), {share:.1f}%, {shards}")
            lines += [
                f"  {s.param:<{name_w}}  {self._range(s):<{range_w}}  {_human(self._nbytes(s)):>10}"
                for s in mine
            ]
        lines.append(f"imbalance {self.imbalance():.4f} (largest load / mean load; 1 is even)")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The placement as JSON, dtypes by torch name (``"float32"``); `from_json` reads it back."""
        doc = {
            "format": _JSON_FORMAT,
            "version": _JSON_VERSION,
            "servers": self.servers,
            "params": [
                {"name": p.name, "shape": list(p.shape), "dtype": dtype_name(p.dtype)} for p in self.params
            ],
            "shards": [
                {"param": s.param, "server": s.server, "start": s.start, "stop": s.stop} for s in self.shards
            ],
        }
        return json.dumps(doc, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Placement:
        """The placement `to_json` wrote; ValueError if ``text`` is not one, or not consistent."""
        try:
            doc = json.loads(text)
            if doc.get("format") != _JSON_FORMAT or doc.get("version") != _JSON_VERSION:
                raise ValueError(f"not a {_JSON_FORMAT} document of version {_JSON_VERSION}")
            return _from_doc(doc)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed placement JSON: {exc!r}") from exc

    def _nbytes(self, shard: Shard) -> int:
        return shard.numel * self._specs[shard.param].dtype.itemsize

    def _range(self, shard: Shard) -> str:
        return f"[{shard.start}:{shard.stop}) of {self._specs[shard.param].numel}"


def plan(params: Sequence[ParamSpec], servers: int, split_bytes: int | None = None) -> Placement:
    """Place ``params`` on ``servers`` servers with even loads (see the module docstring).

    Parameters over ``split_bytes`` are cut across the servers; the others stay whole. By default
    the bound is ``DEFAULT_SPLIT_BYTES``, or a quarter of one server's fair share when that is
    smaller: a model with a few big tensors (an MLP's weight matrices) is then still spread evenly.
    The result depends only on the set of specs, not on their order.
    """
    if servers < 1:
        raise ValueError(f"servers must be at least 1, got {servers}")
    if split_bytes is None:
        fair_share = sum(p.nbytes for p in params) // servers
        split_bytes = max(min(DEFAULT_SPLIT_BYTES, fair_share // 4), 1)
    if split_bytes < 0:
        raise ValueError(f"split_bytes must be at least 0, got {split_bytes}")
    specs = sorted(params, key=lambda p: p.name)
    _by_name(specs)  # refuses duplicate names
    small = [p for p in specs if p.nbytes <= split_bytes]
    large = [p for p in specs if p.nbytes > split_bytes]
    # Small first, then large: water-filling over the packed loads is never worse than packing on
    # top of evenly split large tensors (module docstring, "Why small first").
    loads = [0] * servers
    shards = _pack(small, loads)
    shards += _split(large, _fill(loads, sum(p.nbytes for p in large)))
    shards.sort(key=lambda s: (s.param, s.start))
    return Placement(servers, tuple(specs), tuple(shards))


def _pack(small: Sequence[ParamSpec], loads: list[int]) -> list[Shard]:
    """Greedy largest-first packing of whole tensors; adds what it places to ``loads``."""
    # A heap of (load, server) pops the least-loaded server, the lowest index among equals.
    heap = [(load, server) for server, load in enumerate(loads)]
    heapq.heapify(heap)
    shards = []
    for spec in sorted(small, key=lambda p: (-p.nbytes, p.name)):
        load, server = heapq.heappop(heap)
        shards.append(Shard(spec.name, server, 0, spec.numel))
        loads[server] += spec.nbytes
        heapq.heappush(heap, (load + spec.nbytes, server))
    return shards


def _fill(loads: Sequence[int], total: int) -> list[int]:
    """Bytes of ``total`` each server takes so that the lowest loads rise to one common level."""
    quotas = [0] * len(loads)
    if total == 0:
        return quotas
    order = sorted(range(len(loads)), key=lambda i: (loads[i], i))
    # Raise the k lowest servers together; stop at the first k whose level stays at or below the
    # next server's load. That level is above each of the k loads, so no quota is negative.
    below = 0
    for k in range(1, len(order) + 1):
        below += loads[order[k - 1]]
        if k == len(order) or below + total <= loads[order[k]] * k:
            break
    level, extra = divmod(below + total, k)
    for rank, server in enumerate(order[:k]):
        quotas[server] = level - loads[server] + int(rank < extra)  # the remainder, a byte each
    return quotas


def _split(large: Sequence[ParamSpec], quotas: Sequence[int]) -> list[Shard]:
    """Cut each tensor across the servers in proportion to ``quotas``, on element boundaries."""
    total = sum(quotas)
    shards = []
    for spec in large:
        start = below = 0
        for server, quota in enumerate(quotas):
            below += quota
            # Round the boundaries, not the piece sizes, so the pieces add up to numel exactly;
            # rounding half up in integers keeps every worker's answer the same.
            stop = (2 * spec.numel * below + total) // (2 * total)
            if stop > start:
                shards.append(Shard(spec.name, server, start, stop))
            start = stop
    return shards


def _by_name(params: Sequence[ParamSpec]) -> dict[str, ParamSpec]:
    """Specs by name; ValueError naming the first duplicate."""
    specs: dict[str, ParamSpec] = {}
    for spec in params:
        if spec.name in specs:
            raise ValueError(f"parameter name {spec.name!r} appears twice")
        specs[spec.name] = spec
    return specs


def _index(
    servers: int, params: Sequence[ParamSpec], shards: Sequence[Shard]
) -> dict[str, tuple[Shard, ...]]:
    """Shards by parameter in element order; ValueError unless they cover each parameter once."""
    by_param: dict[str, list[Shard]] = {p.name: [] for p in params}
    for shard in shards:
        if shard.param not in by_param:
            raise ValueError(f"shard {shard.key} is of no known parameter")
        if not 0 <= shard.server < servers:
            raise ValueError(f"shard {shard.key} is on server {shard.server}, not one of {servers}")
        by_param[shard.param].append(shard)
    index = {}
    for spec in params:
        ordered = tuple(sorted(by_param[spec.name], key=lambda s: s.start))
        _check_cover(spec, ordered)
        index[spec.name] = ordered
    return index


def _check_cover(spec: ParamSpec, shards: Sequence[Shard]) -> None:
    """ValueError unless ``shards`` (by start) tile ``[0, numel)`` with no gap, overlap or empty one."""
    if spec.numel == 0:
        if [(s.start, s.stop) for s in shards] != [(0, 0)]:
            raise ValueError(f"parameter {spec.name!r} has no elements and needs exactly one shard [0:0)")
        return
    at = 0
    for shard in shards:
        if shard.start != at or shard.stop <= shard.start:
            raise ValueError(f"shard {shard.key} leaves a gap, overlaps or is empty (expected start {at})")
        at = shard.stop
    if at != spec.numel:
        raise ValueError(f"shards of {spec.name!r} cover [0:{at}) of its {spec.numel} elements")


def _from_doc(doc: dict[str, Any]) -> Placement:
    params = tuple(
        ParamSpec(p["name"], tuple(p["shape"]), dtype_from_name(p["dtype"])) for p in doc["params"]
    )
    shards = tuple(Shard(s["param"], s["server"], s["start"], s["stop"]) for s in doc["shards"])
    return Placement(doc["servers"], params, shards)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"
