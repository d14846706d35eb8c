"""The etcd coordinator against a real etcd on loopback (``LocalEtcd``): who wins a slot, how a
term lives and ends, what a watcher sees, and what a killed and restarted etcd does to each call.

Every wait polls a condition under a deadline; TTLs are 1 s (LocalEtcd's timings allow it).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from tensorwire.coordinator import Coordinator, Leader, Term, open_coordinator
from tensorwire.coordinator.codec import leader_key
from tensorwire.coordinator.local import LocalEtcd
from tensorwire.errors import AuthenticationError, CertificateRefused, CoordinatorUnavailable, LeaseLost
from tensorwire.security import TlsFiles, write_dev_certs

rpc = pytest.importorskip("aetcd.rpc", reason="the etcd extra (aetcd) is not installed")

pytestmark = [
    pytest.mark.slow,  # starts etcd processes
    pytest.mark.skipif(
        shutil.which("etcd") is None, reason="etcd not on PATH (as root: apt-get install etcd-server)"
    ),
]

T = TypeVar("T")
TIMEOUT = 1.0  # the coordinators' own per-call timeout
MARGIN = 0.5  # what a bounded call may take beyond it on a busy 2-core machine


def run(coro: Coroutine[Any, Any, T], limit: float = 30.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, limit)

    return asyncio.run(bounded())


async def eventually(check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, f"not within {within}s: {what}"
        await asyncio.sleep(0.05)


async def next_within(watch: AsyncIterator[Leader | None], within: float) -> Leader | None:
    return await asyncio.wait_for(anext(watch), within)


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


@pytest.fixture
def own_etcd() -> Iterator[LocalEtcd]:
    """An etcd of the test's own: for tests that kill it."""
    with LocalEtcd() as server:
        yield server


def coordinators(url: str, count: int) -> list[Coordinator]:
    return [open_coordinator(url, timeout=TIMEOUT) for _ in range(count)]


async def close_all(items: list[Coordinator]) -> None:
    for item in items:
        await item.close()


def test_one_of_two_members_wins_and_each_new_term_has_a_larger_epoch(etcd: LocalEtcd) -> None:
    async def go() -> None:
        a, b = items = coordinators(etcd.url, 2)
        try:
            first = await a.campaign("wins", "a", "tcp://a:7070", 1)
            assert first is not None
            assert await b.campaign("wins", "b", "tcp://b:7070", 1) is None
            assert await b.leader("wins") == Leader("a", "tcp://a:7070", first.epoch)
            await a.resign(first)
            second = await b.campaign("wins", "b", "tcp://b:7070", 1)
            assert second is not None and second.epoch > first.epoch
            assert await a.leader("wins") == Leader("b", "tcp://b:7070", second.epoch)
            await b.resign(second)
            third = await a.campaign("wins", "a", "tcp://a:7070", 1)
            assert third is not None and third.epoch > second.epoch
        finally:
            await close_all(items)

    run(go())


def test_renewals_keep_a_term_past_its_ttl_and_a_silent_member_loses_it(etcd: LocalEtcd) -> None:
    async def go() -> None:
        a, b = items = coordinators(etcd.url, 2)
        try:
            term = await a.campaign("renew", "a", "tcp://a:7070", 1)
            assert term is not None
            first_epoch, until = term.epoch, time.monotonic() + 2.5 * term.ttl
            while time.monotonic() < until:  # renewing every ttl/4 for 2.5 ttls
                before = time.monotonic()
                term = await a.renew(term)
                assert before <= term.renewed_at <= time.monotonic()  # taken before sending
                assert not term.expired()
                await asyncio.sleep(term.ttl / 4)
            assert await b.leader("renew") == Leader("a", "tcp://a:7070", first_epoch)

            async def gone() -> bool:  # no more renewals: etcd expires the lease
                return await b.leader("renew") is None

            await eventually(gone, term.ttl + 2.0, "the key of a member that stopped renewing went")
            with pytest.raises(LeaseLost):
                await a.renew(term)
            assert await b.campaign("renew", "b", "tcp://b:7070", 1) is not None
        finally:
            await close_all(items)

    run(go())


def test_renew_says_lease_lost_when_the_key_was_deleted_under_the_term(etcd: LocalEtcd) -> None:
    async def go() -> None:
        (a,) = items = coordinators(etcd.url, 1)
        try:
            term = await a.campaign("deleted", "a", "tcp://a:7070", 2)
            assert term is not None
            await raw_delete(etcd, leader_key("/tensorwire", "deleted"))  # an operator's etcdctl del
            with pytest.raises(LeaseLost, match="no longer epoch"):
                await a.renew(term)
        finally:
            await close_all(items)

    run(go())


def test_a_watch_sees_the_leader_its_resignation_and_the_next_leader_in_order(etcd: LocalEtcd) -> None:
    async def go() -> None:
        a, b, watcher = items = coordinators(etcd.url, 3)
        try:
            first = await a.campaign("watched", "a", "tcp://a:7070", 1)
            assert first is not None
            watch = watcher.watch("watched")
            assert await next_within(watch, 2.0) == first.leader
            await a.resign(first)
            assert await next_within(watch, 2.0) is None
            second = await b.campaign("watched", "b", "tcp://b:7070", 1)
            assert second is not None
            assert await next_within(watch, 2.0) == second.leader
            await watcher.close()
            with pytest.raises(StopAsyncIteration):
                await next_within(watch, 2.0)
        finally:
            await close_all(items)

    run(go())


def test_a_killed_etcd_fails_calls_within_their_timeout_and_a_restarted_one_serves_again(
    own_etcd: LocalEtcd,
) -> None:
    async def go() -> None:
        a, b, watcher = items = coordinators(own_etcd.url, 3)
        try:
            first = await a.campaign("killed", "a", "tcp://a:7070", 1)
            assert first is not None
            watch = watcher.watch("killed")
            assert await next_within(watch, 2.0) == first.leader
            await a.resign(first)
            assert await next_within(watch, 2.0) is None  # the watch's stream is open now
            term = await b.campaign("killed", "b", "tcp://b:7070", 5)
            assert term is not None
            assert await next_within(watch, 2.0) == term.leader
            pending = asyncio.ensure_future(anext(watch))  # waits on the stream that breaks
            own_etcd.kill()
            await assert_bounded(lambda: b.renew(term), CoordinatorUnavailable)
            await assert_bounded(lambda: a.leader("killed"), CoordinatorUnavailable)
            await assert_bounded(lambda: a.campaign("killed", "a", "tcp://a:7070", 1), CoordinatorUnavailable)
            await assert_bounded(lambda: b.resign(term), None)  # logged, never raised
            assert not pending.done()
            own_etcd.start()
            # etcd restores leases with their whole TTL: b's key is back; the reopened watch says so.
            assert await asyncio.wait_for(pending, 10.0) == term.leader
            term = await b.renew(term)
            await b.resign(term)
            assert await next_within(watch, 3.0) is None
            again = await a.campaign("killed", "a", "tcp://a:7070", 1)
            assert again is not None and again.epoch > term.epoch
            assert await next_within(watch, 3.0) == again.leader
        finally:
            await close_all(items)

    run(go(), limit=60.0)


async def assert_bounded(call: Callable[[], Awaitable[object]], raises: type[Exception] | None) -> None:
    started = time.monotonic()
    if raises is None:
        await call()
    else:
        with pytest.raises(raises):
            await call()
    assert time.monotonic() - started < TIMEOUT + MARGIN


async def raw_delete(etcd: LocalEtcd, key: bytes) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{etcd.client_port}") as channel:
        await rpc.KVStub(channel).DeleteRange(rpc.DeleteRangeRequest(key=key), timeout=2.0)


def test_term_validity_is_measured_from_before_the_campaign(etcd: LocalEtcd) -> None:
    async def go() -> None:
        (a,) = items = coordinators(etcd.url, 1)
        try:
            before = time.monotonic()
            term: Term | None = await a.campaign("valid", "a", "tcp://a:7070", 2)
            assert term is not None
            assert before <= term.renewed_at <= time.monotonic()
            assert term.valid_until(0.5) == term.renewed_at + term.ttl - 0.5
            assert term.ttl <= 2
            await a.resign(term)
        finally:
            await close_all(items)

    run(go())


def test_etcd_users_authenticate_and_an_expired_token_is_renewed() -> None:
    with LocalEtcd(extra_args=["--auth-token-ttl=1"]) as server:

        async def go() -> None:
            await enable_auth(server, "root", "rootpw")
            async with open_coordinator(server.url, user="root", password="rootpw", timeout=TIMEOUT) as a:
                term = await a.campaign("auth", "a", "tcp://a:7070", 5)
                assert term is not None
                # Idle past the token's 1 s TTL (etcd extends a token on each use, and sweeps
                # expired ones each second): here the wait is the condition under test.
                await asyncio.sleep(2.2)
                term = await a.renew(term)  # "invalid auth token": authenticates again, once
                assert await a.leader("auth") == term.leader
            async with open_coordinator(server.url, user="root", password="wrong", timeout=TIMEOUT) as b:
                with pytest.raises(AuthenticationError, match="refused the credentials"):
                    await b.leader("auth")
            async with open_coordinator(server.url, timeout=TIMEOUT) as c:
                with pytest.raises(AuthenticationError):
                    await c.campaign("auth", "c", "tcp://c:7070", 1)

        run(go())


async def enable_auth(etcd: LocalEtcd, user: str, password: str) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{etcd.client_port}") as channel:
        auth = rpc.AuthStub(channel)
        await auth.UserAdd(rpc.AuthUserAddRequest(name=user, password=password), timeout=2)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role="root"), timeout=2)
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=2)


def test_etcds_speaks_mutual_tls_and_refuses_a_client_without_a_certificate(tmp_path: Path) -> None:
    certs = write_dev_certs(tmp_path / "certs")
    server_files = TlsFiles(cert=certs["server"], key=certs["server_key"], ca=certs["ca"])
    with LocalEtcd(tls=server_files) as server:

        async def go() -> None:
            client = TlsFiles(cert=certs["client"], key=certs["client_key"], ca=certs["ca"])
            async with open_coordinator(server.url, tls=client, timeout=TIMEOUT) as a:
                term = await a.campaign("tls", "a", "tcp://a:7070", 1)
                assert term is not None
                assert await a.leader("tls") == term.leader
            async with open_coordinator(server.url, tls=TlsFiles(ca=certs["ca"]), timeout=TIMEOUT) as b:
                # etcd drops a client without a certificate after TLS 1.3's handshake: gRPC then
                # reports a corrupt stream, not a certificate, so either error may say it.
                with pytest.raises((CertificateRefused, CoordinatorUnavailable)):
                    await b.leader("tls")
            stranger = write_dev_certs(tmp_path / "other")  # trusts another CA: the server fails it
            mistrust = TlsFiles(cert=certs["client"], key=certs["client_key"], ca=stranger["ca"])
            async with open_coordinator(server.url, tls=mistrust, timeout=TIMEOUT) as c:
                with pytest.raises(CertificateRefused, match="TLS with etcd"):
                    await c.leader("tls")

        run(go())
