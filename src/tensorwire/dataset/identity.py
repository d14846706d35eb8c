"""Which tree a data set's name holds on a node, so that a scatter of another tree under the same
name does not overwrite or prune it by mistake.

Every node of a scatter gets ``<dataset>/identity`` before the first item is sent: a uint8 tensor
of JSON naming the plan's identity (``plan.plan_identity``) and, for people, where it came from::

    {"format": "tensorwire.dataset-identity/1", "identity": "<hex>", "dataset": "images",
     "by": "files", "shards": 3, "items": 480, "bytes": 123456, "source": "host:/data/images",
     "written": "2025-01-01T12:00:00Z"}

Before any node is changed, ``scatter`` reads it on every node (``survey``):

- the same identity from the same source (host and absolute path): a re-run (a resume, or the
  repair of what differs), which goes on;
- nothing of the data set there: a new data set;
- another identity, the same identity from another source, shards with no record (written by an
  older tensorwire, or by hand), or a record that cannot be read: ``DatasetConflict`` naming what
  is there, unless ``replace``.

Why the source counts: the identity covers names, sizes and modification times, not contents
(plan.py), so two different trees whose pipelines normalise times (``tar --mtime``, Nix or Bazel
outputs, image layers) and whose files have fixed sizes have one identity. Telling them apart by
where they come from costs nothing; hashing a sample of every file (its first and last KiB) would
read the source once more before anything is sent (one more open per file: millions for a tree of
small files) and still miss trees that differ only inside fixed-layout records. What the source
check leaves: a tree replaced in place at the same path, with equal names, sizes and times, is
taken for the same tree; its items that differ are sent again (each is compared by content hash
on the node), which is that source's update. A tree moved, or scattered from another host, needs
``--replace`` once (only what differs is sent).

The record (and every manifest) comes from a server: it is read only after a STAT shows a 1-D
uint8 tensor within ``MAX_RECORD_BYTES``, into a buffer of that size, and every field is checked.
Manifests also carry the identity, so a node's shards of an older tree (left where a node no longer
owns them) are told apart from this one's and pruned.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tensorwire.client.core import AsyncClient
from tensorwire.dataset.plan import IDENTITY_BYTES, Plan
from tensorwire.errors import InvalidTensor, KeyNotFound, LimitExceeded

IDENTITY_FORMAT = "tensorwire.dataset-identity/1"
MAX_RECORD_BYTES = 64 << 10  # an identity record is a few hundred bytes; a larger one is refused
_SHOWN = 200  # characters of a server's string shown in an error


def identity_name(dataset: str) -> str:
    return f"{dataset}/identity"


def source_of(src: Path) -> str:
    """Where a scatter's tree comes from: ``host:absolute path`` (links resolved)."""
    return f"{socket.gethostname()}:{src.resolve()}"


def record(plan: Plan, identity: str, src: Path) -> bytes:
    """The identity record of ``plan`` (scattered from ``src``), as stored on each node."""
    body = {
        "format": IDENTITY_FORMAT, "identity": identity, "dataset": plan.dataset, "by": plan.by,
        "shards": len(plan.shards), "items": sum(len(s.items) for s in plan.shards),
        "bytes": sum(s.nbytes for s in plan.shards), "source": source_of(src),
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    return json.dumps(body).encode()


@dataclass(frozen=True, slots=True)
class Held:
    """What one node holds under a data set's name, as far as an overwrite is concerned."""

    identity: str | None  # the record's identity; None: no record (or none that could be read)
    shards: bool  # whether any name lies under <dataset>/shard-
    about: str  # the record, for people ("" without one)
    unreadable: str = ""  # why a record that is there could not be read
    source: str | None = None  # the record's source (``source_of``; None: it names none)

    def conflict(self, ours: str, source: str) -> str | None:
        """What a scatter of identity ``ours`` from ``source`` would overwrite here, or None if
        nothing (the module docstring says why the source counts)."""
        if self.unreadable:
            return f"an identity record that cannot be read ({self.unreadable})"
        if self.identity is None and self.shards:
            return "shards with no identity record (scattered by an older tensorwire, or put by hand)"
        if self.identity is None:
            return None
        if self.identity != ours:
            return f"it from another tree, an edited one or other options: {self.about}"
        if self.source is not None and self.source != source:
            return (
                "a tree with the same names, sizes and times (contents are not compared) from another"
                f" source, not this scatter's {_shown(source)}: {self.about}"
            )
        return None

    def ours(self, identity: str, source: str) -> bool:
        """Whether the record here is this scatter's already (nothing to write again)."""
        return self.identity == identity and self.source in (None, source)


async def survey(client: AsyncClient, dataset: str) -> Held:
    """What the node behind ``client`` holds under ``dataset`` (no change made)."""
    shards = bool(await client.list(f"{dataset}/shard-", limit=1))
    try:
        raw = await read_small(client, identity_name(dataset), MAX_RECORD_BYTES)
    except KeyNotFound:
        return Held(None, shards, "")
    except (InvalidTensor, LimitExceeded) as exc:
        return Held(None, shards, "", unreadable=str(exc))
    try:
        body = parse_record(raw)
    except InvalidTensor as exc:
        return Held(None, shards, "", unreadable=str(exc))
    source = body.get("source")
    return Held(body["identity"], shards, _about(body), source=source if isinstance(source, str) else None)


async def read_small(client: AsyncClient, name: str, limit: int) -> bytes:
    """The bytes of the 1-D uint8 tensor ``name``, read only if a STAT shows at most ``limit`` of
    them (into a buffer of that size: a server cannot make this side allocate more).
    KeyNotFound if there is none; InvalidTensor or LimitExceeded if it is not such a tensor."""
    meta = await client.stat(name)
    if meta.dtype != torch.uint8 or len(meta.shape) != 1:
        raise InvalidTensor(f"{name!r} is {meta.dtype} of shape {list(meta.shape)}, not 1-D uint8 bytes")
    if meta.nbytes > limit:
        raise LimitExceeded(f"{name!r} holds {meta.nbytes} bytes, more than the {limit} it may have")
    out = torch.empty(meta.nbytes, dtype=torch.uint8)
    await client.get(name, out)  # a tensor of another size now: refused, never grown into
    return bytes(out.numpy())


def parse_record(raw: bytes) -> dict[str, Any]:
    """The record's fields, checked (InvalidTensor naming what is wrong)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidTensor(f"not JSON ({str(exc)[:_SHOWN]})") from exc
    if not isinstance(body, dict) or body.get("format") != IDENTITY_FORMAT:
        raise InvalidTensor(f"not a {IDENTITY_FORMAT} record")
    identity = body.get("identity")
    if not isinstance(identity, str) or not 0 < len(identity) <= IDENTITY_BYTES:
        raise InvalidTensor("its 'identity' is not a digest")
    return body


def _about(body: dict[str, Any]) -> str:
    """The record for an error message: each field a server wrote is shown escaped and cut short."""
    fields = {key: _shown(body.get(key)) for key in ("source", "by", "shards", "items", "bytes", "written")}
    return (
        f"{fields['source']} ({fields['shards']} shards by {fields['by']}, {fields['items']} items, "
        f"{fields['bytes']} B, written {fields['written']})"
    )


def _shown(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return "?"
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, str):
        return "?"
    text = value[:_SHOWN]
    return text if text.isprintable() else repr(text)  # no escape sequence reaches a terminal
