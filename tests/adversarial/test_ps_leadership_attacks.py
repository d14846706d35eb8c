"""What a client, an etcd reader, or a slow or garbled coordinator can do to a slot whose primary
etcd's lease decides (``ps serve --coordinator``, ps/server/leadership.py), and what they must not.

- A client session (no peer token) sending PS_REPLICATE with a huge epoch, to the primary or the
  backup: refused; no step-down, no takeover, roles and epochs unchanged.
- An etcd user with read access to the prefix (what workers need) cannot create the leader key,
  write the in-sync set, nor end the primary's term, even knowing its epoch and lease.
- Garbage in the leader key while no one leads: no replica becomes the primary (the slot is down),
  and the servers keep answering; garbage in the in-sync set: no backup takes over once the
  primary is gone (it reads an empty set, and says why).
- etcd paused (SIGSTOP: a coordinator that does not answer) past the ttl: the primary serves on only
  under the failsafe, while its backup applies every change; once the backup stops too, it steps
  down within the ttl and a few seconds, and acknowledges nothing more (a push in flight included).

Every wait polls a condition under a deadline; a window in which something must *not* happen is
watched for a bounded time, each sample checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import torch

from tensorwire import transport as transports
from tensorwire.coordinator import Term, open_coordinator
from tensorwire.coordinator.codec import in_sync_key, leader_key
from tensorwire.coordinator.local import LocalEtcd
from tensorwire.errors import AuthenticationError, NotAuthorized, NotPrimary, TensorwireError
from tensorwire.ps import Coordination, ParamServer, Worker
from tensorwire.ps.launch import free_port, replica_flags
from tensorwire.ps.server import replication as rp
from tensorwire.security import Security, write_token_file
from tensorwire.server import ServerThread
from tensorwire.testing.faults import sigstop
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.testing.process import param_server_of as ps_of
from tensorwire.testing.process import ps_role as role
from tensorwire.testing.process import ps_stats as stats
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.types import Address
from tensorwire.wire import ps as wps
from tensorwire.wire.frame import Opcode

rpc = pytest.importorskip("aetcd.rpc", reason="the etcd extra (aetcd) is not installed")
pytestmark = [
    pytest.mark.slow,  # every test starts etcd
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd not on PATH (apt-get install etcd-server)"),
]

PEER = Security(token="the-peer-token-of-this-slot")
PREFIX = "/tensorwire"
TTL = 1.0  # the in-process slots'
WITHIN = 15.0  # a takeover or a step-down, on a busy 2-core machine
TOP = (1 << 64) - 1
T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], limit: float = 30.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, limit)

    return asyncio.run(bounded())


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    # The in-process servers' first optimizer would stall their loop past a 1 s term (torch.optim's
    # first use imports torch._dynamo): done once here, in this process, before any slot starts.
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with LocalEtcd(prefix=PREFIX) as server:
        yield server


# -- in-process slots -------------------------------------------------------------------------------
def replica(etcd: LocalEtcd, slot: str, urls: list[str], index: int) -> ServerThread:
    """Replica ``index`` of ``slot``: the first campaigns at once, the other a ttl later."""
    ps = ParamServer(
        backups=[u for i, u in enumerate(urls) if i != index],
        peer=PEER,
        standby=index > 0,
        coordinator=Coordination(etcd.url, slot, urls[index], ttl=TTL, timeout=1.0),
    )
    return ServerThread([urls[index]], extensions=[ps])


def leading(server: ServerThread) -> dict[str, Any]:
    status: dict[str, Any] = ps_of(server).leadership_status()
    return status


def alive(server: ServerThread) -> bool:
    """Its leadership's tasks still run: nothing the coordinator answered made them fail."""
    tasks = ps_of(server)._replica.leadership._tasks
    return bool(tasks) and not any(t.done() for t in tasks)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def steps(worker: Worker, net: torch.nn.Module, first: int, count: int) -> None:
    for step in range(first, first + count):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        torch.nn.functional.cross_entropy(net(x), y).backward()  # type: ignore[no-untyped-call]
        worker.step()


def never(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """Check for ``seconds`` that ``condition()`` never holds (a bounded window, sampled)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert not condition(), what
        time.sleep(0.05)


def replicate(url: str, epoch: int) -> None:
    """A hand-made PS_REPLICATE (a PING at ``epoch``) from an ordinary client session."""

    async def call() -> None:
        conn = await transports.open_transport(Address.parse(url), transports.TransportOptions(5.0, 10.0))
        try:
            assert isinstance(conn, FramedTransport)
            meta = rp.encode(rp.Change.PING, epoch, wps.PsHead(wps.OBSERVER))
            (await conn.call(Opcode.PS_REPLICATE, meta, [], what="a hand-made PS_REPLICATE")).done()
        finally:
            await conn.close()

    run(call())


async def raw_put(etcd: LocalEtcd, key: bytes, value: bytes) -> None:
    """Write ``key`` as someone with write access to the prefix would (bound to a 60 s lease)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{etcd.client_port}") as channel:
        lease = (await rpc.LeaseStub(channel).LeaseGrant(rpc.LeaseGrantRequest(TTL=60), timeout=2)).ID
        await rpc.KVStub(channel).Put(rpc.PutRequest(key=key, value=value, lease=lease), timeout=2)


# -- a client cannot make a replica step down or take over ---------------------------------------
def test_a_client_replicating_a_huge_epoch_makes_no_replica_step_down_or_take_over(etcd: LocalEtcd) -> None:
    urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    first, second = replica(etcd, "client", urls, 0), replica(etcd, "client", urls, 1)
    with first, second:
        wait_for(lambda: ps_of(first).role == "primary", WITHIN, "the first replica to take the lease")
        net = model()
        with Worker(net, "|".join(urls), "async", rank=0, timeout=30) as worker:
            steps(worker, net, 0, 2)
            wait_for(lambda: leading(first)["in_sync"] == urls, WITHIN, "the backup in the in-sync set")
            epoch = ps_of(first).epoch
            for server in (first, second):
                for attack in (epoch + 1, rp.MAX_EPOCH - 1, TOP):
                    with pytest.raises(
                        AuthenticationError, match="PS_REPLICATE is served only to the replicas"
                    ):
                        replicate(server.url, attack)
                assert ps_of(server).replicate_refused["not_peer"] == 3
            # Nor does a worker's request to the backup make it take over: the lease decides.
            with pytest.raises(NotPrimary):
                Worker(torch.nn.Linear(4, 2), urls[1], "async", rank=0, heartbeat=0, timeout=3).start()
            assert [(ps_of(s).role, ps_of(s).epoch) for s in (first, second)] == [
                ("primary", epoch),
                ("backup", epoch),
            ]
            assert leading(first)["step_downs"] == 0 and leading(first)["holds_term"]
            assert leading(second)["leader_epoch"] == epoch and not leading(second)["holds_term"]
            steps(worker, net, 2, 1)  # it still serves, and still replicates
            assert ps_of(first).version == ps_of(second).version == 3


# -- an etcd reader cannot write the leadership ----------------------------------------------------
def test_a_read_only_etcd_user_cannot_create_the_leader_key_write_the_in_sync_set_or_end_a_term() -> None:
    with LocalEtcd(prefix=PREFIX) as server:

        async def go() -> None:
            await enable_auth(server)
            replicas = open_coordinator(server.url, user="root", password="rootpw", timeout=2)
            reader = open_coordinator(server.url, user="worker", password="workerpw", timeout=2)
            async with replicas, reader:
                with pytest.raises(NotAuthorized):
                    await reader.campaign("free", "w", "tcp://w:1", 5)
                assert await reader.leader("free") is None  # it may read: nothing was created
                term = await replicas.campaign("held", "a", "tcp://a:1", 5)
                assert term is not None
                await replicas.set_in_sync(term, ["a", "b"])
                # What a reader sees of the term (the key's create revision and lease) is enough to
                # name it, not to act for it.
                forged = Term("held", "w", "tcp://w:1", term.epoch, await lease_of(server, "held"), 5, 0)
                with pytest.raises(NotAuthorized):
                    await reader.set_in_sync(forged, ["w"])
                await reader.resign(forged)  # best-effort, never raises: it must change nothing
                assert await reader.leader("held") == term.leader
                in_sync = await reader.in_sync("held")
                assert in_sync is not None and in_sync.members == ("a", "b")
                assert (await replicas.renew(term)).epoch == term.epoch  # the term holds

        run(go(), 60)


async def enable_auth(etcd: LocalEtcd) -> None:
    """root (the replicas' user), and ``worker``: read access to the prefix, as workers need."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{etcd.client_port}") as channel:
        auth = rpc.AuthStub(channel)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="rootpw"), timeout=2)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=2)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="reader"), timeout=2)
        start, end = f"{PREFIX}/".encode(), f"{PREFIX}0".encode()  # the prefix's range
        read = rpc.Permission(permType=rpc.Permission.READ, key=start, range_end=end)
        await auth.RoleGrantPermission(
            rpc.AuthRoleGrantPermissionRequest(name="reader", perm=read), timeout=2
        )
        await auth.UserAdd(rpc.AuthUserAddRequest(name="worker", password="workerpw"), timeout=2)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="worker", role="reader"), timeout=2)
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=2)


async def lease_of(etcd: LocalEtcd, slot: str) -> int:
    """The leader key's lease, as the reader reads it (a raw range with its token)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{etcd.client_port}") as channel:
        auth = rpc.AuthStub(channel)
        token = (await auth.Authenticate(rpc.AuthenticateRequest(name="worker", password="workerpw"))).token
        reply = await rpc.KVStub(channel).Range(
            rpc.RangeRequest(key=leader_key(PREFIX, slot)), timeout=2, metadata=(("token", token),)
        )
        (kv,) = reply.kvs
        return int(kv.lease)


# -- a garbled coordinator -------------------------------------------------------------------------
LEADER_GARBAGE = {
    "not-json": b"\xff\xfe not json",
    "names-the-backup-with-an-epoch": b'{"v":1,"member":"%s","address":"%s","epoch":99}',
}


@pytest.mark.parametrize("name", sorted(LEADER_GARBAGE))
def test_garbage_in_the_leader_key_keeps_the_slot_down_and_the_servers_up(etcd: LocalEtcd, name: str) -> None:
    slot = f"garbage-leader-{name}"
    urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    value = LEADER_GARBAGE[name].replace(b"%s", urls[1].encode())
    run(raw_put(etcd, leader_key(PREFIX, slot), value))
    first, second = replica(etcd, slot, urls, 0), replica(etcd, slot, urls, 1)
    with first, second:
        # Past the standby's wait and several campaigns of each: neither may take the key.
        never(lambda: "primary" in (ps_of(first).role, ps_of(second).role), 3 * TTL, "a primary")
        for server in (first, second):
            assert alive(server), "a leadership task ended"
            assert leading(server)["leader"] is None and leading(server)["step_downs"] == 0
            assert stats(server.url)["role"] == "backup"  # it still answers
        with pytest.raises(NotPrimary, match="no primary is known"):
            Worker(torch.nn.Linear(4, 2), "|".join(urls), "async", rank=0, heartbeat=0, timeout=2).start()


IN_SYNC_GARBAGE = {
    "not-json": b"\xff\xfe not json",
    "a-string-holding-the-backup": b'{"v":1,"members":"%s"}',  # `url in members` would be true
    "the-backup-and-an-extra-field": b'{"v":1,"members":["%s"],"by":"root"}',
}


@pytest.mark.parametrize("name", sorted(IN_SYNC_GARBAGE))
def test_garbage_in_the_in_sync_set_keeps_every_backup_from_taking_over(etcd: LocalEtcd, name: str) -> None:
    slot = f"garbage-in-sync-{name}"
    urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    with replica(etcd, slot, urls, 1) as second:
        with replica(etcd, slot, urls, 0) as first:
            wait_for(lambda: ps_of(first).role == "primary", WITHIN, "the first replica to take the lease")
            net = model()
            with Worker(net, "|".join(urls), "async", rank=0, timeout=30) as worker:
                steps(worker, net, 0, 2)
                wait_for(lambda: leading(first)["in_sync"] == urls, WITHIN, "the backup in the in-sync set")
            # The set as written stays (the primary rewrites it only when its backups change).
            run(
                raw_put(
                    etcd, in_sync_key(PREFIX, slot), IN_SYNC_GARBAGE[name].replace(b"%s", urls[1].encode())
                )
            )
        # The primary resigned: the lease is free at once, and the backup reads the set.
        wait_for(lambda: leading(second)["down"], WITHIN, "the backup to say the slot is down")
        assert "is not in it" in leading(second)["down"]
        never(lambda: ps_of(second).role == "primary", 2 * TTL, "the backup took over")
        assert alive(second)


# -- a stalled primary -----------------------------------------------------------------------------
def test_a_primary_that_gave_up_its_term_and_won_it_back_keeps_replicating(etcd: LocalEtcd) -> None:
    """A primary gives its term up (here as when the in-sync set cannot be written; a term run
    out during a stall goes the same way) and, the lease expired, wins the next at a newer epoch:
    it must ping its backups again, so that a backup started afterwards gets the state, joins the
    in-sync set and can take over."""
    urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    with replica(etcd, "won-back", urls, 0) as first:
        wait_for(lambda: ps_of(first).role == "primary", WITHIN, "the first replica to take the lease")
        warm_up(urls[0])  # a first job: the primary serves, and so pings its (absent) backup
        epoch, held = ps_of(first).epoch, ps_of(first)._replica

        async def give_up() -> None:
            held.leadership.give_up(held, "the in-sync set could not be written (the test says)")

        first._thread.call(give_up(), WITHIN, "giving the term up")
        wait_for(
            lambda: ps_of(first).role == "primary" and ps_of(first).epoch > epoch, WITHIN, "the term again"
        )
        with replica(etcd, "won-back", urls, 1) as second:
            net = model()
            with Worker(net, "|".join(urls), "async", rank=0, timeout=30) as worker:
                steps(worker, net, 0, 3)
                wait_for(lambda: leading(first)["in_sync"] == urls, WITHIN, "the backup in the in-sync set")
                first.close()  # it resigns: the backup takes over at once
                wait_for(lambda: ps_of(second).role == "primary", WITHIN, "the backup to take over")
                steps(worker, net, 3, 2)
                assert ps_of(second).version == 5


# -- a slow coordinator ----------------------------------------------------------------------------
SLOW_TTL = 2.0
IN_FLIGHT = 4 * 2.0 + 1.0  # a change to a stopped backup is given up on after 8 s (replica.py)


def warm_up(url: str) -> None:
    """A first job on the server at ``url``, ended at once. A server's first job stalls its event
    loop a second or two (its first torch.optim optimizer imports torch._dynamo), long enough for
    a 2 s term to run out: paid here, before the slot's backup starts, not in the window tested."""
    net = torch.nn.Linear(4, 2)
    with Worker(net, url, "async", rank=0, heartbeat=0, timeout=WITHIN) as worker:
        torch.nn.functional.mse_loss(net(torch.ones(2, 4)), torch.zeros(2, 2)).backward()  # type: ignore[no-untyped-call]
        worker.step()


def test_a_paused_etcd_leaves_the_primary_serving_only_under_the_failsafe_until_its_backup_stops_too(
    tmp_path: Path,
) -> None:
    with ExitStack() as stack:
        etcd = stack.enter_context(LocalEtcd(prefix=PREFIX))
        peer = write_token_file(tmp_path / "peer.token")
        urls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        lease = ["--coordinator", etcd.url, "--slot", "slow", "--lease-ttl", str(SLOW_TTL)]
        stack.enter_context(ServerProcess(urls[0], extra=[*replica_flags(urls, 0, peer), *lease]))
        wait_for(lambda: role(urls[0]) == "primary", WITHIN, "the first replica to take the lease")
        warm_up(urls[0])
        second = stack.enter_context(ServerProcess(urls[1], extra=[*replica_flags(urls, 1, peer), *lease]))
        wait_for(lambda: role(urls[0]) == "primary", WITHIN, "the first replica to hold the lease")
        net = model()
        # Only the primary: a push it refuses is resent to it, and fails at the worker's timeout.
        with leaving_quietly(
            Worker(net, urls[0], "async", rank=0, heartbeat=0.25, timeout=IN_FLIGHT + 3)
        ) as worker:
            steps(worker, net, 0, 2)
            wait_for(
                lambda: urls[1] in stats(urls[0])["coordinator"]["in_sync"], WITHIN, "the backup in sync"
            )
            doc = stats(urls[0])
            epoch, downs = doc["epoch"], doc["coordinator"]["step_downs"]  # (the warm-up may have)
            paused = stack.enter_context(paused_process(etcd_pid(etcd)))
            wait_for(lambda: stats(urls[0])["coordinator"]["failsafe"], WITHIN, "the failsafe to be said")
            assert time.monotonic() - paused > SLOW_TTL / 2  # (it holds its term until ttl - margin)
            steps(worker, net, 2, 3)  # served under the failsafe, and replicated
            doc = stats(urls[0])
            assert (doc["role"], doc["epoch"], doc["coordinator"]["failsafe"]) == ("primary", epoch, True)
            assert stats(urls[1])["version"] == doc["version"] == 5
            # Now the backup stops too, with a push on its way: the primary cannot have it applied.
            sigstop(second.proc)()
            stopped = time.monotonic()
            outcome = PushInThread(worker, net, 5)
            wait_for(lambda: role(urls[0]) == "backup", SLOW_TTL + 5, "the primary to step down")
            stepped_down = time.monotonic() - stopped
            outcome.join(IN_FLIGHT + 10)
            assert not outcome.is_alive(), "the push neither failed nor was acknowledged"
            assert isinstance(outcome.error, TensorwireError), (
                "a push was acknowledged after the backup stopped"
            )
            doc = stats(urls[0])
            assert (doc["role"], doc["version"], doc["coordinator"]["step_downs"]) == ("backup", 5, downs + 1)
        print(f"ttl {SLOW_TTL}s: stepped down {stepped_down:.2f}s after its backup stopped")


class PushInThread(threading.Thread):
    """One training step in a thread; ``error`` is what it raised (None: acknowledged)."""

    def __init__(self, worker: Worker, net: torch.nn.Module, step: int) -> None:
        super().__init__(daemon=True)
        self.worker, self.net, self.step = worker, net, step
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            steps(self.worker, self.net, self.step, 1)
        except BaseException as exc:
            self.error = exc


def etcd_pid(etcd: LocalEtcd) -> int:
    proc = etcd._proc  # LocalEtcd keeps its process to itself; the test pauses it
    assert proc is not None
    return proc.pid


@contextlib.contextmanager
def leaving_quietly(worker: Worker) -> Iterator[Worker]:
    """The worker, started; closed at the end, where leaving a slot with no primary fails."""
    worker.start()
    try:
        yield worker
    finally:
        with contextlib.suppress(TensorwireError):
            worker.close()


@contextlib.contextmanager
def paused_process(pid: int) -> Iterator[float]:
    """SIGSTOP ``pid`` (yields when, a time.monotonic()); SIGCONT it on the way out."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
