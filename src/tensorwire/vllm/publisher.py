"""A trainer's side of a weight update, without vLLM: publish one generation of weights under a
prefix, from one process or as one part per rank.

A generation is atomic: readers see all of it or none of it, so a trainer killed mid-publish
leaves the engines on the last complete generation. With ``world_size`` ranks, each rank publishes
its part (``publish_part``) under one transaction id that every rank derives from ``run_id`` and
the round, so no rank waits for another to tell it. Ranks call ``publish`` in lockstep, the same
number of times, failed rounds included (the store answers a transaction id it has ended with that
end, so a round is never retried under its id); a job restarted after a rank died takes a new
``run_id``; the generation appears when the last part is
in. A part that does not come within ``part_timeout`` aborts the whole (every rank's ``publish``
raises ``WaitTimeout``), as does a part that fails or whose connection closes (``PublishAborted``);
either way nothing of it is visible and readers keep the previous generation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from tensorwire.client.core import Client, connect
from tensorwire.errors import InvalidTensor
from tensorwire.security import TlsFiles
from tensorwire.types import Generation
from tensorwire.vllm.layout import MAX_VERSION_BYTES, VERSION_KEY
from tensorwire.wire.generations import TXN_BYTES


@dataclass(frozen=True)
class PublisherOptions:
    """``url``/``prefix``: the store and the prefix the engines read. ``rank``/``world_size``: this
    trainer process's part of each generation; ``run_id`` (with several ranks) ties the ranks'
    parts of one generation together, the same string on every rank. ``timeout``: one request;
    ``part_timeout``: how long the store waits for every rank's part."""

    url: str
    prefix: str
    token: str | None = field(default=None, repr=False)
    tls: TlsFiles | None = None
    rank: int = 0
    world_size: int = 1
    run_id: str = ""
    timeout: float = 120.0
    part_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} of a world of {self.world_size}")
        if self.world_size > 1 and not self.run_id:
            raise ValueError("with several ranks, give every rank the same run_id (it names their parts)")


def version_record(version: str) -> torch.Tensor:
    """``version`` as the fixed-size uint8 record published beside the weights."""
    raw = version.encode("utf-8")
    if not raw or len(raw) > MAX_VERSION_BYTES or b"\0" in raw:
        raise InvalidTensor(
            f"a weight version is 1 to {MAX_VERSION_BYTES} UTF-8 bytes without NUL: {version[:40]!r}"
        )
    record = torch.zeros(MAX_VERSION_BYTES, dtype=torch.uint8)
    record[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return record


class WeightPublisher:
    """Publishes the trainer's weights, one generation per ``publish``."""

    def __init__(self, options: PublisherOptions) -> None:
        self.options = options
        self.rounds = 0  # generations this publisher took part in
        self._client: Client | None = None

    @property
    def client(self) -> Client:
        if self._client is None:
            o = self.options
            self._client = connect(o.url, token=o.token, tls=o.tls, timeout=o.timeout)
        return self._client

    def mine(self, names: list[str], held: Collection[str] | None) -> set[str]:
        """The names this rank publishes: with one rank, all; with several, the ones it holds when
        each rank holds its own (pipeline or expert parallel, ``held``), else (every rank holds
        every name, as FSDP's gathered tensors) name ``i`` goes to rank ``i % world_size``."""
        o = self.options
        if o.world_size == 1:
            return set(names)
        if held is not None:
            return set(held)
        return {n for i, n in enumerate(names) if i % o.world_size == o.rank}

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]], version: str | None = None) -> Generation:
        """One generation of ``weights`` (this rank's part of it, with several ranks); ``version``,
        if given, is published with it and becomes the engines' weight version."""
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if name == VERSION_KEY or name in tensors:
                raise InvalidTensor(f"{name!r} twice, or the reserved name of the version record")
            tensors[name] = _sendable(tensor)
        if version is not None and self.options.rank == 0:
            tensors[VERSION_KEY] = version_record(version)
        self.rounds += 1
        return self._send(tensors)

    def _send(self, tensors: Mapping[str, torch.Tensor]) -> Generation:
        o = self.options
        if o.world_size == 1:
            return self.client.publish(o.prefix, tensors)
        txn = hashlib.sha256(f"{o.run_id}\0{o.prefix}\0{self.rounds}".encode()).digest()[:TXN_BYTES]
        return self.client.publish_part(
            o.prefix, tensors, txn=txn, index=o.rank, count=o.world_size, timeout=o.part_timeout
        )

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _sendable(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor of ``tensor``'s values (a copy only when it is not one already)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    return tensor.contiguous()
