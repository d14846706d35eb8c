"""The etcd v3 coordinator: a slot's leader is the key ``{prefix}/slots/{slot}/leader``, created
only when absent (a transaction comparing its create revision with 0) and bound to the winner's
lease, so that the key goes when the lease does. A term's epoch is the key's create revision:
etcd's revisions only grow, so each new term of a slot has a larger one.

Lifecycle and guarantees are ``Coordinator``'s (base.py). What etcd hands back is checked before
use (codec.py): a revision or lease that is not a positive int64, a value that is not ours.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from aetcd import rpc

from tensorwire.client.retry import RetryPolicy, backoff, retrying
from tensorwire.coordinator import codec
from tensorwire.coordinator.base import DEFAULT_TIMEOUT, Coordinator, InSync, Leader, Term
from tensorwire.coordinator.etcd_rpc import EtcdConnection, Stubs, log_ignored
from tensorwire.coordinator.url import CoordinatorUrl
from tensorwire.coordinator.watch import open_watch
from tensorwire.errors import CoordinatorUnavailable, LeaseLost, TensorwireError
from tensorwire.logs import event
from tensorwire.security import TlsFiles

log = logging.getLogger("tensorwire.coordinator")

MAX_TTL = 3600.0  # a term longer than an hour would leave a dead primary's slot empty that long
WATCH_IDLE = 10.0  # seconds a watch stream may be quiet before etcd is asked to show it is alive
# After a broken watch stream: retry until the coordinator is closed, never more than 1 s apart.
WATCH_RETRY = RetryPolicy(retries=None, delay=backoff(0.05, 1.0))


class EtcdCoordinator(Coordinator):
    """``Coordinator`` over etcd's v3 gRPC API (``etcd://``, ``etcds://`` over TLS)."""

    def __init__(
        self,
        url: CoordinatorUrl,
        *,
        tls: TlsFiles | None = None,
        user: str | None = None,
        password: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        watch_idle: float = WATCH_IDLE,
    ) -> None:
        if not 0 < timeout <= 3600:
            raise ValueError(f"coordinator timeout {timeout!r} is not in (0, 3600] seconds")
        if url.scheme == "etcds" and tls is None:
            tls = TlsFiles()  # TLS with the system's CA store
        self.prefix = url.prefix
        self.timeout = timeout
        self.watch_idle = watch_idle
        self._conn = EtcdConnection(url.endpoints, tls=tls, user=user, password=password, timeout=timeout)
        self._closed = asyncio.Event()

    # -- campaign, renew, resign ---------------------------------------------------------------
    async def campaign(
        self,
        slot: str,
        member: str,
        address: str,
        ttl: float,
        *,
        in_sync_revision: int | None = None,
        incarnation: int = 0,
    ) -> Term | None:
        """Three calls at most, each bounded by the timeout: grant a lease, create the key in a
        transaction, and (lost, or failed after the grant) revoke the lease."""
        key = codec.leader_key(self.prefix, slot)
        value = codec.encode_leader(member, address, incarnation)
        if not 1 <= ttl <= MAX_TTL:
            raise ValueError(f"lease ttl {ttl!r} is not in [1, {MAX_TTL:.0f}] seconds")
        started = time.monotonic()  # the lease's clock starts at etcd after this
        lease_id, granted = await self._grant(slot, ttl)
        try:
            epoch = await self._create(slot, key, value, lease_id, in_sync_revision)
        except BaseException:
            # The transaction may have been applied before the failure: revoking the lease takes
            # the key with it, so that no term exists that its member does not know of.
            await self._revoke(lease_id, f"the lease of a failed campaign for slot {slot}")
            raise
        if epoch is None:
            await self._revoke(lease_id, f"the lease of a lost campaign for slot {slot}")
            return None
        return Term(slot, member, address, epoch, lease_id, min(float(ttl), granted), started, incarnation)

    async def _grant(self, slot: str, ttl: float) -> tuple[int, float]:
        async def op(stubs: Stubs, left: float) -> Any:
            request = rpc.LeaseGrantRequest(TTL=math.ceil(ttl))  # whole seconds; the term keeps ttl
            return await stubs.lease.LeaseGrant(request, timeout=left, metadata=stubs.metadata)

        reply = await self._conn.call(f"lease grant for slot {slot}", op)
        try:
            lease_id = codec.check_revision(reply.ID, "lease id")
            granted = codec.check_revision(reply.TTL, "lease TTL")
        except codec.BadValue as exc:
            raise CoordinatorUnavailable(f"etcd granted an unusable lease for slot {slot}: {exc}") from exc
        return lease_id, float(granted)

    async def _create(
        self, slot: str, key: bytes, value: bytes, lease_id: int, in_sync_revision: int | None
    ) -> int | None:
        """The new key's create revision, or None if the key exists (or the in-sync set is no
        longer the one at ``in_sync_revision``)."""
        absent = rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.CREATE, key=key, create_revision=0)
        compare = [absent]
        if in_sync_revision is not None:
            in_sync = codec.in_sync_key(self.prefix, slot)
            compare.append(
                rpc.Compare(
                    result=rpc.Compare.EQUAL,
                    target=rpc.Compare.MOD,
                    key=in_sync,
                    mod_revision=in_sync_revision,
                )
            )

        async def op(stubs: Stubs, left: float) -> Any:
            put = rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease_id))
            request = rpc.TxnRequest(compare=compare, success=[put], failure=[])
            return await stubs.kv.Txn(request, timeout=left, metadata=stubs.metadata)

        reply = await self._conn.call(f"campaign for slot {slot}", op)
        if not reply.succeeded:
            return None
        try:
            return codec.check_revision(reply.header.revision, "transaction revision")
        except codec.BadValue as exc:
            raise CoordinatorUnavailable(f"etcd answered the campaign for slot {slot}: {exc}") from exc

    async def renew(self, term: Term) -> Term:
        budget = min(self.timeout, term.ttl / 3)
        sent = time.monotonic()  # before the keepalive leaves: the term's bound stays conservative
        ttl = await self._keepalive(term, budget)
        left = max(budget - (time.monotonic() - sent), 0.001)
        await self._check_still_ours(term, left)
        return dataclasses.replace(term, ttl=min(term.ttl, ttl), renewed_at=sent)

    async def _keepalive(self, term: Term, budget: float) -> float:
        async def op(stubs: Stubs, left: float) -> Any:
            call = stubs.lease.LeaseKeepAlive(timeout=left, metadata=stubs.metadata)
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=term.lease_id))
                return await call.read()
            finally:
                call.cancel()

        what = f"lease keepalive for slot {term.slot} (epoch {term.epoch})"
        reply = await self._conn.call(what, op, budget)
        if reply is None or not hasattr(reply, "TTL"):  # grpc.aio.EOF: the stream ended unanswered
            raise CoordinatorUnavailable(f"etcd ended the {what} without an answer")
        try:
            ttl = codec.check_int64(reply.TTL, "lease TTL")
        except codec.BadValue as exc:
            raise CoordinatorUnavailable(f"etcd answered the {what}: {exc}") from exc
        if ttl == 0 or term.lease_id != reply.ID:
            raise LeaseLost(f"slot {term.slot}: the lease of epoch {term.epoch} has expired or was revoked")
        return float(ttl)

    async def _check_still_ours(self, term: Term, budget: float) -> None:
        kv = await self._get(term.slot, budget)
        if kv is None or kv.create_revision != term.epoch or kv.lease != term.lease_id:
            raise LeaseLost(f"slot {term.slot}: the leader key is no longer epoch {term.epoch}'s")

    # -- the in-sync set ------------------------------------------------------------------------
    async def in_sync(self, slot: str) -> InSync | None:
        key = codec.in_sync_key(self.prefix, slot)
        kvs = list((await self._range(slot, key, None)).kvs)
        if not kvs:
            return None
        if len(kvs) > 1 or kvs[0].key != key:
            event(log, logging.WARNING, "etcd answered a read of one key with others", slot=slot)
            return InSync((), 0)
        try:
            return codec.decode_in_sync(key, kvs[0].value, kvs[0].mod_revision)
        except codec.BadValue as exc:
            raise CoordinatorUnavailable(
                f"etcd answered the read of slot {slot}'s in-sync set: {exc}"
            ) from exc

    async def set_in_sync(self, term: Term, members: Sequence[str]) -> None:
        """One transaction: the set is written only while the leader key is ``term``'s (its
        create revision and lease)."""
        leader = codec.leader_key(self.prefix, term.slot)
        value = codec.encode_in_sync(tuple(members))
        equal = rpc.Compare.EQUAL
        ours = [
            rpc.Compare(result=equal, target=rpc.Compare.CREATE, key=leader, create_revision=term.epoch),
            rpc.Compare(result=equal, target=rpc.Compare.LEASE, key=leader, lease=term.lease_id),
        ]
        key = codec.in_sync_key(self.prefix, term.slot)
        put = rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value))

        async def op(stubs: Stubs, left: float) -> Any:
            request = rpc.TxnRequest(compare=ours, success=[put], failure=[])
            return await stubs.kv.Txn(request, timeout=left, metadata=stubs.metadata)

        reply = await self._conn.call(f"write of slot {term.slot}'s in-sync set", op)
        if not reply.succeeded:
            raise LeaseLost(f"slot {term.slot}: the leader key is no longer epoch {term.epoch}'s")

    async def revoke(self, leader: Leader) -> None:
        if leader.lease:
            await self._revoke(leader.lease, f"the lease of {leader.address} (epoch {leader.epoch}), gone")

    async def resign(self, term: Term) -> None:
        await self._revoke(term.lease_id, f"the lease of slot {term.slot} (epoch {term.epoch})")

    async def _revoke(self, lease_id: int, what: str) -> None:
        async def op(stubs: Stubs, left: float) -> None:
            await stubs.lease.LeaseRevoke(
                rpc.LeaseRevokeRequest(ID=lease_id), timeout=left, metadata=stubs.metadata
            )

        try:
            await self._conn.call(f"revoke {what}", op)
        except TensorwireError as exc:
            if "lease not found" not in str(exc):  # gone already: what revoking wanted
                log_ignored(f"revoke {what}", exc)

    # -- reading and watching ------------------------------------------------------------------
    async def leader(self, slot: str) -> Leader | None:
        _, found = await self._read(slot)
        return found

    async def _read(self, slot: str, budget: float | None = None) -> tuple[int, Leader | None]:
        """The revision of the read, and the slot's leader at it."""
        key = codec.leader_key(self.prefix, slot)
        reply = await self._range(slot, key, budget)
        revision = self._revision(reply, slot)
        kvs = list(reply.kvs)
        if not kvs:
            return revision, None
        if len(kvs) > 1 or kvs[0].key != key:
            event(log, logging.WARNING, "etcd answered a read of one key with others", slot=slot)
            return revision, None
        kv = kvs[0]
        return revision, codec.decode_or_warn(key, kv.value, kv.create_revision, kv.lease)

    async def _get(self, slot: str, budget: float | None) -> Any:
        key = codec.leader_key(self.prefix, slot)
        kvs = list((await self._range(slot, key, budget)).kvs)
        return kvs[0] if len(kvs) == 1 and kvs[0].key == key else None

    async def _range(self, slot: str, key: bytes, budget: float | None) -> Any:
        async def op(stubs: Stubs, left: float) -> Any:
            return await stubs.kv.Range(rpc.RangeRequest(key=key), timeout=left, metadata=stubs.metadata)

        return await self._conn.call(f"read of slot {slot}'s leader", op, budget)

    @staticmethod
    def _revision(reply: Any, slot: str) -> int:
        try:
            return codec.check_revision(reply.header.revision, "header revision")
        except codec.BadValue as exc:
            raise CoordinatorUnavailable(f"etcd answered the read of slot {slot}: {exc}") from exc

    async def watch(self, slot: str) -> AsyncIterator[Leader | None]:
        key = codec.leader_key(self.prefix, slot)
        revision, current = await self._read(slot)  # the first read raises like leader()
        while True:
            yield current
            stream = open_watch(self._conn, key, revision + 1, self.watch_idle, self._closed)
            try:
                async for change in stream:
                    yield change
            except CoordinatorUnavailable as exc:
                event(log, logging.WARNING, "coordinator watch broke; reopening", slot=slot, error=str(exc))
            finally:
                await stream.aclose()
            if self._closed.is_set():
                return
            reopened = await self._reread(slot)
            if reopened is None:
                return
            revision, current = reopened

    async def _reread(self, slot: str) -> tuple[int, Leader | None] | None:
        """The slot's leader after a broken watch, read again with backoff; None once closed."""

        async def connect() -> None:
            if self._closed.is_set():
                raise _Closed("closed")

        async def op(_: None) -> tuple[int, Leader | None]:
            return await self._read(slot)

        try:
            return await retrying(op, connect, WATCH_RETRY)
        except _Closed:
            return None

    async def close(self) -> None:
        self._closed.set()
        await asyncio.sleep(0)  # let watches see it before their channel goes
        await self._conn.close()


class _Closed(TensorwireError):
    """The coordinator was closed while a watch waited to reopen: the watch ends."""
