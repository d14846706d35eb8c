"""Send the shards of a data set to the nodes that will train on them: in parallel, verified, resumable.

Shard k goes to node ``k % len(urls)``; each node is served by its own thread, event loop and
connections. For every item of a shard, in order:

1. read it from the source and hash it (xxh3-64);
2. if the node already holds it with the same dtype, shape and hash (``DIGEST``, answered by the
   server from the bytes it holds), skip it;
3. else send it (``put``: per-chunk checksums; large items resume after a broken connection).

Then the node hashes every item of the shard again and each must match its source (an
end-to-end check of the bytes at rest, not of the transfer); the manifest is written, and checked
the same way; then names under the shard's prefix that the plan does not have are deleted (a
reader reads only what a manifest lists, so it never meets one of them half gone). A node holding
a shard's manifest therefore holds all of it, verified; before the first item of a shard that
differs from what the node holds, its old manifest is deleted.

Three phases, so that a mistake or a failure never costs the only copy of something:

1. survey (identity.py): before anything changes anywhere, every node says which tree the data
   set's name holds there. Another tree (or options that make another plan: ``--shards``,
   ``--by``, ``--block-size``, an edited source; or a tree of the same identity from another
   host or path) is refused with ``DatasetConflict`` unless ``replace``: a second scatter of a
   different tree under the same name must not prune the first. A node that cannot be surveyed
   is not written to (its report says why).
2. send: each node gets the plan's identity record first, then its shards, as above.
3. tidy, only once every node has verified its shards: each node drops the data set's shards it
   does not own (those numbered past the plan's count, left by more ``--shards``, and, where no
   two URLs reach one store, those that now belong to another node), manifests first. Before
   that, every shard has a verified copy on its owner; if a node failed, nothing is dropped and
   the report says so (a re-run finishes it).

Files are assigned to shards by rendezvous hashing (plan.py), so after one file is added, edited
or removed at the source, a re-run sends or prunes that file alone (with ``replace``: an edited
tree is another tree, whose scatter overwrites and prunes what the nodes hold).

What a re-run after an interruption sends: only items the node does not hold, verified. An item
in flight when the sender died is not visible on the node (a put becomes visible only once all
of it is verified), so it is sent again in full: per node, at most the item in flight at the
interruption is sent twice; no item that landed is.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from tensorwire import transport as transports
from tensorwire._aio import Deadline, asyncio_timeout, run
from tensorwire.client.core import AsyncClient, ClientOptions
from tensorwire.client.options import retry_policy, transport_options
from tensorwire.client.retry import retrying
from tensorwire.dataset import identity as ids
from tensorwire.dataset.digest import Digest, fetch_digests
from tensorwire.dataset.plan import Expected, Item, Plan, Shard, Split, make_plan, manifest, plan_identity
from tensorwire.errors import DatasetConflict, TensorwireError, VerificationFailed
from tensorwire.transport.base import FrameChannel
from tensorwire.types import Address, MiB
from tensorwire.wire.checksum import ChecksumKind, checksum
from tensorwire.wire.tensors import byte_view

Advance = Callable[[int, int], None]  # (node index, bytes done)
WHAT = "dataset scatter"  # who needs the frame protocol, in the error for an address without it
T = TypeVar("T")


@dataclass(slots=True)
class NodeReport:
    """What one node got: ``sent_*`` crossed the network in this run, ``skipped_*`` were already there."""

    url: str
    shards: list[int]
    items: int = 0
    bytes: int = 0
    sent_items: int = 0
    sent_bytes: int = 0
    skipped_items: int = 0
    skipped_bytes: int = 0
    pruned: int = 0  # names under the shards' prefixes that the plan does not have, deleted
    verified: bool = False  # every item and manifest hashed on the node and matched its source
    seconds: float = 0.0
    error: str | None = None
    replaced: str | None = None  # with replace: what the name held here before (identity.py)
    tidy: str | None = None  # why shards this node no longer owns were kept (phase 3 not run)


@dataclass(slots=True)
class ScatterReport:
    dataset: str
    by: str
    shards: int
    nodes: list[NodeReport] = field(default_factory=list)
    identity: str = ""  # the plan's (plan.plan_identity)

    @property
    def ok(self) -> bool:
        return all(node.verified for node in self.nodes)

    def as_dict(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "by": self.by, "shards": self.shards, "ok": self.ok,
                "identity": self.identity, "items": sum(n.items for n in self.nodes),
                "bytes": sum(n.bytes for n in self.nodes),
                "nodes": [asdict(n) for n in self.nodes]}  # fmt: skip


def scatter(
    src: Path,
    urls: Sequence[str],
    *,
    shards: int | None = None,
    by: Split = "files",
    dataset: str | None = None,
    block_bytes: int = 64 * MiB,
    max_rate: float | None = None,
    options: ClientOptions | None = None,
    advance: Advance | None = None,
    on_plan: Callable[[Plan, list[NodeReport]], None] | None = None,
    deadline: Deadline | None = None,
    replace: bool = False,
) -> ScatterReport:
    """Scatter ``src`` over the servers at ``urls`` (``shards`` defaults to one per node).

    ``max_rate`` caps each node's sending in bytes/s (to leave a training job its network).
    Failures of one node do not stop the others; they are recorded in its ``NodeReport.error``.
    ``deadline`` bounds the whole scatter: a node not done by then is cut off (its connections
    closed) and reported as failed; a re-run resumes it. DatasetConflict, before anything is
    sent, if a node holds a data set of that name from another tree (or other options), unless
    ``replace``: then it is overwritten and what the new plan does not have is pruned.
    """
    if not urls:
        raise ValueError("scatter needs at least one node URL")
    for url in urls:
        check_node(url)
    plan = make_plan(src, shards or len(urls), by, dataset, block_bytes)
    report = _report_for(plan, urls)
    opts = options or ClientOptions()
    source = ids.source_of(src)
    surveyed = _survey(plan, report, opts, deadline)
    _refuse_conflicts(plan, report, surveyed, source, replace)
    if on_plan is not None:
        on_plan(plan, report.nodes)
    claim = ids.record(plan, report.identity, src)

    def sender(i: int) -> _NodeSender:
        """Node ``i``'s sender: it records the data set's name there unless the node holds it already."""
        progress = (lambda n: advance(i, n)) if advance else None
        seen = surveyed[i]
        mine = seen is not None and seen.held.ours(report.identity, source)
        return _NodeSender(plan, report.identity, report.nodes[i], opts, max_rate=max_rate, advance=progress,
                           claim=None if mine else claim)  # fmt: skip

    _send_all(plan, report, [i for i in range(len(urls)) if surveyed[i] is not None], sender, deadline)
    _tidy(plan, report, surveyed, opts, deadline)
    return report


def _report_for(plan: Plan, urls: Sequence[str]) -> ScatterReport:
    """The report to fill: each node's shards (shard k goes to node k mod N), items and bytes."""
    report = ScatterReport(plan.dataset, plan.by, len(plan.shards), identity=plan_identity(plan))
    for i, url in enumerate(urls):
        owned = [s for s in plan.shards if s.index % len(urls) == i]
        node = NodeReport(url, [s.index for s in owned], sum(len(s.items) for s in owned))
        node.bytes = sum(s.nbytes for s in owned)
        report.nodes.append(node)
    return report


def _send_all(
    plan: Plan,
    report: ScatterReport,
    reached: list[int],
    sender: Callable[[int], _NodeSender],
    deadline: Deadline | None,
) -> None:
    """Every node of ``reached`` sent its shards, each on a thread of its own, at once; a node's
    failure (or a thread still stuck past the deadline) is that node's ``error``."""

    def serve_node(i: int) -> None:
        node = report.nodes[i]
        start = time.monotonic()
        owned = [plan.shards[k] for k in node.shards]
        send = sender(i)
        try:
            run(_bounded(send.send(owned), deadline))
        except Exception as exc:  # the thread's boundary: one node's failure is that node's report
            node.error = f"{type(exc).__name__}: {exc}"
        node.seconds = time.monotonic() - start

    threads = {
        i: threading.Thread(target=serve_node, args=(i,), name=f"scatter-{i}", daemon=True) for i in reached
    }
    for t in threads.values():
        t.start()
    for i, t in threads.items():
        # Each node's calls are bounded by the client's timeouts and its loop by the deadline;
        # this join is the backstop for a thread stuck outside both (reading a source file).
        t.join(None if deadline is None else deadline.remaining() + JOIN_GRACE)
        if t.is_alive():
            report.nodes[
                i
            ].error = f"TransferTimeout: {deadline.what if deadline else 'scatter'} ran out of time"


JOIN_GRACE = 10.0  # seconds past the deadline a node's thread has to close its connections


@dataclass(frozen=True, slots=True)
class _Surveyed:
    """What phase 1 found on a node: what its name holds, and which store answered."""

    held: ids.Held
    store_id: int  # 0: the server does not say


def _survey(
    plan: Plan, report: ScatterReport, options: ClientOptions, deadline: Deadline | None
) -> list[_Surveyed | None]:
    """Phase 1: what every node holds under the data set's name, all at once on one loop; None
    for a node that could not be asked (its report says why: nothing is sent to it)."""

    async def one(node: NodeReport) -> _Surveyed | None:
        client = AsyncClient(node.url, options)
        try:
            held = await _bounded(ids.survey(client, plan.dataset), deadline)
            transport = client.current_transport
            return _Surveyed(held, transport.info.store_id if transport is not None else 0)
        except Exception as exc:  # that node's failure, in its report; the others go on
            node.error = f"{type(exc).__name__}: {exc}"
            return None
        finally:
            with contextlib.suppress(TensorwireError):
                await client.close()

    async def every() -> list[_Surveyed | None]:
        return list(await asyncio.gather(*(one(node) for node in report.nodes)))

    return run(every())


def _refuse_conflicts(
    plan: Plan, report: ScatterReport, surveyed: list[_Surveyed | None], source: str, replace: bool
) -> None:
    """DatasetConflict naming every node whose name holds another tree (another identity, or the
    same one from another ``source``), unless ``replace`` (then each such node's report says
    what was replaced)."""
    found: dict[str, list[str]] = {}  # what is there -> the nodes holding it
    for node, seen in zip(report.nodes, surveyed, strict=True):
        conflict = seen.held.conflict(report.identity, source) if seen is not None else None
        if conflict is None:
            continue
        if replace:
            node.replaced = conflict
        else:
            found.setdefault(conflict, []).append(node.url)
    if found:
        what = f"{len(plan.shards)} shards by {plan.by}, {sum(len(s.items) for s in plan.shards)} items"
        held = "; ".join(f"{_nodes(urls)} {conflict}" for conflict, urls in list(found.items())[:3])
        raise DatasetConflict(
            f"refusing to overwrite data set {plan.dataset!r}: {held}. This scatter ({what}) would "
            "overwrite it and prune what it does not have: pass --replace to do so (only what differs "
            "is sent), or --name to scatter under another name. Nothing was sent."
        )


def _nodes(urls: list[str]) -> str:
    """``urls`` as the subject of "hold(s)": the first few of them."""
    shown = ", ".join(urls[:3]) + (f" and {len(urls) - 3} more" if len(urls) > 3 else "")
    return f"{shown} holds" if len(urls) == 1 else f"{shown} hold"


def _tidy(
    plan: Plan, report: ScatterReport, surveyed: list[_Surveyed | None], options: ClientOptions,
    deadline: Deadline | None,
) -> None:  # fmt: skip
    """Phase 3: once every node holds its shards verified, each drops the shards it does not own
    (see the module doc); if one failed, none does, and each report says so."""
    failed = [node.url for node in report.nodes if not node.verified]
    if failed:
        for node in report.nodes:
            node.tidy = f"shards no longer owned kept: {len(failed)} node(s) did not finish ({failed[0]}...)"
        return
    stores = [seen.store_id if seen is not None else 0 for seen in surveyed]
    owned_by: dict[int, set[int]] = {}
    for node, store in zip(report.nodes, stores, strict=True):
        owned_by.setdefault(store, set()).update(node.shards)
    # Two URLs may reach one store: a shard is kept where any of them owns it. A store that does
    # not say who it is may be another URL's too: there only shards past the count are dropped.
    known = 0 not in owned_by

    async def one(node: NodeReport, store: int) -> None:
        keep = owned_by[store] if known else set(range(len(plan.shards)))
        client = AsyncClient(node.url, options)
        try:
            node.pruned += await _bounded(_drop_shards(client, plan, keep), deadline)
        except Exception as exc:  # the shards are all verified: this node keeps some it need not
            node.tidy = f"shards no longer owned kept: {type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(TensorwireError):
                await client.close()

    async def every() -> None:
        await asyncio.gather(*(one(node, store) for node, store in zip(report.nodes, stores, strict=True)))

    run(every())


async def _drop_shards(client: AsyncClient, plan: Plan, keep: set[int]) -> int:
    """Delete the data set's shards on ``client``'s node but those in ``keep``, manifests first (a
    reader never takes a half-deleted shard as complete); how many names were deleted."""
    shard = re.compile(re.escape(plan.dataset) + r"/shard-(\d{5,})/")
    manifests: list[str] = []
    items: list[str] = []
    for meta in await client.list(plan.dataset + "/shard-"):
        found = shard.match(meta.name)
        if found and int(found[1]) not in keep:
            (manifests if meta.name == found[0] + "manifest" else items).append(meta.name)
    for batch in (manifests, items):
        if batch:
            await client.delete_many(batch)
    return len(manifests) + len(items)


async def _bounded(coro: Awaitable[T], deadline: Deadline | None) -> T:
    """``coro``, cancelled at ``deadline`` (TransferTimeout naming it): the sender's finally closes
    its connections."""
    if deadline is None:
        return await coro
    async with asyncio_timeout(deadline.remaining(), deadline.what):
        return await coro


class _NodeSender:
    """Sends one node its shards, on one event loop: a client for puts, a connection for DIGEST.
    ``identity``: the plan's; ``claim``: the identity record to write before anything else (None:
    the node has it already)."""

    def __init__(
        self, plan: Plan, identity: str, node: NodeReport, options: ClientOptions, *,
        max_rate: float | None, advance: Callable[[int], None] | None, claim: bytes | None,
    ) -> None:  # fmt: skip
        self.plan = plan
        self.identity = identity
        self.claim = claim
        self.node = node
        self.max_rate = max_rate
        self.advance = advance or (lambda n: None)
        self.client = AsyncClient(node.url, options)
        self.digests = _Digests(node.url, options)
        self._started = time.monotonic()
        self._paced_bytes = 0

    async def send(self, shards: Sequence[Shard]) -> None:
        try:
            if self.claim is not None:  # first: an interrupted run leaves the name claimed by this tree
                record = torch.frombuffer(bytearray(self.claim), dtype=torch.uint8)
                await self.client.put(ids.identity_name(self.plan.dataset), record)
            for shard in shards:
                await self._send_shard(shard)
        finally:
            await self.digests.close()
            await self.client.close()
        self.node.verified = True

    async def _send_shard(self, shard: Shard) -> None:
        held = await self.digests.get([*(i.name for i in shard.items), shard.manifest_name])
        sources: dict[str, Expected] = {}
        manifest_valid = shard.manifest_name in held
        for item in shard.items:
            tensor = await asyncio.to_thread(item.load)
            value = checksum(ChecksumKind.XXH3_64, byte_view(tensor))
            sources[item.name] = (tensor.dtype, tuple(tensor.shape), value)
            if _matches(held.get(item.name), sources[item.name]):
                self.node.skipped_items += 1
                self.node.skipped_bytes += item.nbytes
                self.advance(item.nbytes)
                continue
            if manifest_valid:  # the shard is about to change: it is not complete until re-verified
                await self.client.delete(shard.manifest_name)
                manifest_valid = False
            await self.client.put(item.name, tensor, progress=self.advance)
            self.node.sent_items += 1
            self.node.sent_bytes += item.nbytes
            await self._pace(item.nbytes)
        await self._verify(shard.items, sources)
        await self._write_manifest(shard, sources)
        await self._prune(shard)

    async def _verify(self, items: Sequence[Item], sources: dict[str, Expected]) -> None:
        held = await self.digests.get([item.name for item in items])
        bad = [item.name for item in items if not _matches(held.get(item.name), sources[item.name])]
        if bad:
            raise VerificationFailed(
                f"{self.node.url} holds {len(bad)} item(s) that differ from their source after sending: "
                f"{', '.join(bad[:3])}"
            )

    async def _prune(self, shard: Shard) -> None:
        wanted = {item.name for item in shard.items} | {shard.manifest_name}
        stale = [m.name for m in await self.client.list(shard.prefix) if m.name not in wanted]
        if stale:
            await self.client.delete_many(stale)
            self.node.pruned += len(stale)

    async def _write_manifest(self, shard: Shard, sources: dict[str, Expected]) -> None:
        raw = manifest(self.plan, shard, sources, self.identity)
        expected = (torch.uint8, (len(raw),), checksum(ChecksumKind.XXH3_64, raw))
        held = await self.digests.get([shard.manifest_name])
        if not _matches(held.get(shard.manifest_name), expected):
            await self.client.put(shard.manifest_name, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        written = Item(shard.manifest_name, len(raw), Path())
        await self._verify([written], {shard.manifest_name: expected})

    async def _pace(self, nbytes: int) -> None:
        """Sleep so this node's sending stays under ``max_rate`` bytes/s on average."""
        if not self.max_rate:
            return
        self._paced_bytes += nbytes
        ahead = self._paced_bytes / self.max_rate - (time.monotonic() - self._started)
        if ahead > 0:
            await asyncio.sleep(ahead)


def check_node(url: str) -> str:
    """``url`` if scatter can send to it: DIGEST is an opcode of the frame protocol (not gRPC);
    UnsupportedTransport (a ValueError) naming the scheme otherwise, before anything is sent."""
    transports.check_channel(url, what=WHAT)
    return url


def _matches(held: Digest | None, source: Expected) -> bool:
    if held is None:
        return False
    dtype, shape, value = source
    return held.meta.dtype == dtype and tuple(held.meta.shape) == shape and held.value == value


class _Digests:
    """DIGEST requests to one server (an extension opcode: the client API has no call for it), on
    a connection of their own, retried like the client's reads (a digest changes nothing), each
    retry on a new connection."""

    def __init__(self, url: str, options: ClientOptions) -> None:
        self.address = Address.parse(url)
        self.options = options
        self._conn: FrameChannel | None = None

    async def get(self, names: Sequence[str]) -> dict[str, Digest]:
        return await retrying(
            lambda conn: fetch_digests(conn, names),
            self._open,
            retry_policy(self.options),
            on_retry=self._drop,
        )

    async def _open(self) -> FrameChannel:
        if self._conn is None or self._conn.closed:
            self._conn = await transports.open_channel(
                self.address, transport_options(self.options), what=WHAT
            )
        return self._conn

    async def _drop(self, _: TensorwireError) -> None:
        await self.close()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(TensorwireError):
                await conn.close()
