"""The parameter server end to end: real servers on loopback ports, workers in threads.

* sync with W workers at batch b equals one process at batch W*b (SGD+momentum, Adam; 1-3 servers)
* ssp:s never applies a push staler than s, and its gate really holds a worker back
* async records the staleness it lets through; uneven data finishes; every wait names its cause
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from tensorwire.errors import InvalidTensor, ProtocolError, TransferTimeout
from tensorwire.ps import SGD, Adam, AdamW, OptimizerSpec, ParamServer, Worker, digits, pull_parameters
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread
from tensorwire.testing.process import run_threads, wait_for
from tensorwire.transport.frame_client import FramedTransport

W, B, STEPS = 2, 8, 100
DEADLINE = 120.0


def small_model() -> torch.nn.Module:
    """Tanh, not ReLU: Adam divides each element's step by its own gradient scale, so for an
    element whose true gradient is ~0 (a dead ReLU unit's bias) the 1e-9 rounding difference
    between "mean over the batch" and "mean of the workers' means" becomes a full +-lr step.
    That is Adam's conditioning, not the parameter server's; a smooth activation avoids it."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    n = STEPS * W * B
    return torch.randn(n, 20, generator=gen), torch.randint(0, 5, (n,), generator=gen)


@contextlib.contextmanager
def cluster(servers: int, wait_timeout: float = 60.0) -> Iterator[list[str]]:
    """Servers that keep a job when its workers leave: the tests read it after training."""
    threads = [ServerThread(extensions=[ParamServer(wait_timeout, keep_jobs=True)]) for _ in range(servers)]
    try:
        yield [t.url for t in threads]
    finally:
        for t in threads:
            t.close()


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = F.cross_entropy(model(x), y)
    return loss


def reference(spec: OptimizerSpec, x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    """One process, batch W*B, plain torch.optim."""
    model = small_model()
    optimizer = spec.build(model.parameters())  # type: ignore[arg-type]
    for step in range(STEPS):
        rows = slice(step * W * B, (step + 1) * W * B)
        optimizer.zero_grad()
        loss_of(model, x[rows], y[rows]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    return model


def train_sync(urls: list[str], spec: OptimizerSpec, x: torch.Tensor, y: torch.Tensor) -> torch.nn.Module:
    models = [small_model() for _ in range(W)]

    def work(rank: int) -> None:
        # split_bytes=1 KiB cuts the 5 KiB weight across servers: ranges, not only whole tensors
        with Worker(models[rank], urls, "sync", spec, rank=rank, world_size=W, split_bytes=1024) as worker:
            for step in range(STEPS):
                rows = slice(step * W * B + rank * B, step * W * B + (rank + 1) * B)
                loss_of(models[rank], x[rows], y[rows]).backward()  # type: ignore[no-untyped-call]
                worker.step()

    run_threads(work, W, DEADLINE)
    for other in models[1:]:  # every worker ends with the same parameters
        for a, b in zip(models[0].parameters(), other.parameters(), strict=True):
            assert torch.equal(a, b)
    return models[0]


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in pairs)


@pytest.mark.parametrize(
    "spec", [SGD(lr=0.1, momentum=0.9, weight_decay=1e-4), Adam(lr=1e-2)], ids=["sgd-momentum", "adam"]
)
def test_sync_equals_single_process_training(
    spec: OptimizerSpec, data: tuple[torch.Tensor, torch.Tensor]
) -> None:
    x, y = data
    expected = reference(spec, x, y)
    results = []
    for servers in (1, 2, 3):
        with cluster(servers) as urls:
            results.append(train_sync(urls, spec, x, y))
            stats = server_stats(urls)
        assert all(s["step"] == STEPS and s["pushes_applied"] == STEPS * W for s in stats)
        assert max_diff(results[-1], expected) <= 1e-5, f"{servers} server(s)"
        assert max_diff(results[-1], small_model()) > 1e-2  # it did train
    assert max_diff(results[0], results[1]) <= 1e-6 and max_diff(results[0], results[2]) <= 1e-6


def test_adamw_and_a_torch_optimizer_instance_are_accepted(data: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = data
    model = small_model()
    local = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    expected = reference(AdamW(lr=1e-2, weight_decay=0.1), x, y)
    with cluster(2) as urls:
        got = train_sync(urls, local, x, y)  # type: ignore[arg-type]
    assert max_diff(got, expected) <= 1e-5


def test_ssp_gate_holds_the_fast_worker_and_bounds_staleness() -> None:
    bound, steps = 2, 12
    models = [small_model() for _ in range(W)]
    x, y = torch.randn(B, 20), torch.randint(0, 5, (B,))
    slow_may_start = threading.Event()

    def work(rank: int) -> None:
        with Worker(models[rank], urls, f"ssp:{bound}", SGD(lr=0.01), rank=rank, world_size=W) as worker:
            if rank == 1:
                assert slow_may_start.wait(DEADLINE), "the fast worker never reached the gate"
            for _ in range(steps):
                loss_of(models[rank], x, y).backward()  # type: ignore[no-untyped-call]
                worker.step()

    def fast_is_held() -> bool:
        workers = server_stats(urls)[0]["workers"]
        return len(workers) == W and workers["0"]["clock"] == bound + 1

    with cluster(2) as urls:
        thread = threading.Thread(target=run_threads, args=(work, W, DEADLINE), daemon=True)
        thread.start()
        # Worker 1 joined and sits at clock 0: worker 0 must stop at clock s+1, pulling.
        wait_for(fast_is_held, DEADLINE, f"worker 0 to reach clock {bound + 1}")
        assert server_stats(urls)[0]["workers"]["1"]["clock"] == 0
        slow_may_start.set()
        thread.join(DEADLINE)
        assert not thread.is_alive()
        stats = server_stats(urls)
    for s in stats:
        assert s["pushes_applied"] == W * steps
        assert s["max_staleness"] == bound  # worker 0's pushes at clocks 0..s saw worker 1 at 0
        assert all(int(k) <= bound for k in s["staleness"])


def test_async_applies_every_push_and_records_its_staleness() -> None:
    steps = 8
    models = [small_model() for _ in range(W)]
    x, y = torch.randn(B, 20), torch.randint(0, 5, (B,))
    first_done = threading.Event()

    def work(rank: int) -> None:
        with Worker(models[rank], urls, "async", SGD(lr=0.01), rank=rank, world_size=W) as worker:
            if rank == 1:
                assert first_done.wait(DEADLINE)
            for _ in range(steps):
                loss_of(models[rank], x, y).backward()  # type: ignore[no-untyped-call]
                result = worker.step()
            if rank == 0:
                assert result.staleness == steps - 1  # worker 1 never moved while worker 0 ran
                first_done.set()

    with cluster(1) as urls:
        run_threads(work, W, DEADLINE)
        (stats,) = server_stats(urls)
    assert stats["pushes_applied"] == stats["version"] == W * steps
    assert stats["max_staleness"] == steps - 1


@pytest.mark.parametrize("mode", ["async", "ssp:2"])
def test_async_and_ssp_reach_the_demo_accuracy(mode: str) -> None:
    config = digits.TrainConfig(mode=mode)
    with cluster(2) as urls:
        run_threads(lambda rank: digits.train_worker(urls, config, rank=rank, world_size=W), W, DEADLINE)
        model = digits.make_model()
        pull_parameters(model, urls)
    held_out = digits.load()
    assert digits.accuracy(model, held_out.x_test, held_out.y_test) >= 0.95


def test_uneven_data_finishes_without_a_hang() -> None:
    steps = {0: 5, 1: 17}
    models = [small_model() for _ in range(W)]
    x, y = torch.randn(B, 20), torch.randint(0, 5, (B,))

    def work(rank: int) -> None:
        with Worker(models[rank], urls, "sync", SGD(lr=0.01), rank=rank, world_size=W, timeout=30) as worker:
            for _ in range(steps[rank]):
                loss_of(models[rank], x, y).backward()  # type: ignore[no-untyped-call]
                worker.step()

    with cluster(2) as urls:
        run_threads(work, W, timeout=60)
        stats = server_stats(urls)
    for s in stats:
        assert s["step"] == 17 and s["pushes_applied"] == 5 * 2 + 12
        assert not any(w["live"] for w in s["workers"].values())


def test_a_worker_starting_after_the_others_pushed_joins_the_first_step() -> None:
    """No sync step is taken before every rank joined, so a rank joining for the first time after
    the others pushed for step 0 (a process that started later) is in step 0: the run is not
    shifted by a step. (A worker that rejoins after a drop starts at the next one instead.)"""
    models = [small_model() for _ in range(W)]
    x, y = torch.randn(B, 20), torch.randint(0, 5, (B,))
    with (
        cluster(2) as urls,
        Worker(models[0], urls, "sync", SGD(lr=0.1), rank=0, world_size=W, heartbeat=0, timeout=30) as first,
    ):
        loss_of(models[0], x, y).backward()  # type: ignore[no-untyped-call]
        first.push().result(DEADLINE)  # recorded for step 0, which waits for rank 1 to join
        with Worker(
            models[1], urls, "sync", SGD(lr=0.1), rank=1, world_size=W, heartbeat=0, timeout=30
        ) as late:
            assert late.clock == 0
            loss_of(models[1], x, y).backward()  # type: ignore[no-untyped-call]
            late.step()
        first.pull()
        stats = server_stats(urls)
    assert all(s["step"] == 1 and s["pushes_applied"] == 2 for s in stats)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_missing_worker_times_out_naming_whom_it_waited_for() -> None:
    model = small_model()
    with cluster(1) as urls, Worker(model, urls, "sync", SGD(), rank=0, world_size=2, timeout=0.5) as worker:
        loss_of(model, torch.randn(B, 20), torch.randint(0, 5, (B,))).backward()  # type: ignore[no-untyped-call]
        with pytest.raises(TransferTimeout, match=r"step 0 to be taken.*never joined: 1"):
            worker.step()


def test_bad_pushes_are_refused_and_the_server_keeps_serving() -> None:
    model = small_model()
    with cluster(1) as urls, Worker(model, urls, "async", SGD(), rank=0, world_size=1) as worker:
        conn = worker._slots[0].conn
        from tensorwire.types import TensorMeta
        from tensorwire.wire import meta as wm
        from tensorwire.wire import ps as wps
        from tensorwire.wire.frame import Opcode

        async def push(metas: list[TensorMeta], data: list[memoryview], clock: int = 0) -> None:
            head = wps.PsHead(0, 1, clock, 1, 1000, worker.job).encode()
            tail = wps.encode_push_tail(None, worker.incarnation)  # as this worker's session
            await conn.call(Opcode.PS_PUSH, head + wm.encode_records(metas) + tail, data, what="a bad push")

        shard = worker.placement.on_server(0)[0]
        short = torch.zeros(shard.numel - 1)
        wrong_size = [TensorMeta(shard.key, torch.float32, (shard.numel - 1,), short.numel() * 4)]
        with pytest.raises(ProtocolError, match="every shard"):  # one shard of several
            worker._loop().call(push(wrong_size, [memoryview(short.numpy()).cast("B")]), 10, "push")
        keys = worker.placement.on_server(0)
        metas = [TensorMeta(s.key, torch.float32, (s.numel,), s.numel * 4) for s in keys]
        metas[0] = TensorMeta(keys[0].key, torch.float32, (keys[0].numel - 1,), (keys[0].numel - 1) * 4)
        data = [memoryview(torch.zeros(m.shape[0]).numpy()).cast("B") for m in metas]
        with pytest.raises(InvalidTensor, match="gradient"):
            worker._loop().call(push(metas, data), 10, "push")
        with pytest.raises(ProtocolError, match="clock"):
            worker._loop().call(push([], [], clock=7), 10, "push")
        before = [p.detach().clone() for p in model.parameters()]
        loss_of(model, torch.randn(B, 20), torch.randint(0, 5, (B,))).backward()  # type: ignore[no-untyped-call]
        assert worker.step().clock == 0  # the refused pushes changed nothing: this is clock 0
        assert (
            max(float((p.detach() - q).abs().max()) for p, q in zip(model.parameters(), before, strict=True))
            > 0
        )


def test_workers_must_agree_on_the_job() -> None:
    with (
        cluster(1) as urls,
        Worker(small_model(), urls, "sync", SGD(lr=0.1), rank=0, world_size=2, timeout=5, job="run"),
    ):
        with pytest.raises(ProtocolError, match="job 'run' runs"):
            Worker(
                small_model(), urls, "async", SGD(lr=0.1), rank=1, world_size=2, timeout=5, job="run"
            ).start()
        with pytest.raises(ProtocolError, match="world"):
            Worker(
                small_model(), urls, "sync", SGD(lr=0.1), rank=1, world_size=3, timeout=5, job="run"
            ).start()


def test_a_sync_worker_cannot_push_ahead_of_the_step() -> None:
    """Gradients for future steps would pile up on the server: a second push before a pull is refused."""
    model = small_model()
    x, y = torch.randn(B, 20), torch.randint(0, 5, (B,))
    with cluster(1) as urls, Worker(model, urls, "sync", SGD(), rank=0, world_size=2, timeout=5) as worker:
        loss_of(model, x, y).backward()  # type: ignore[no-untyped-call]
        worker.push().result()  # step 0 waits for worker 1, who never comes
        loss_of(model, x, y).backward()  # type: ignore[no-untyped-call]
        with pytest.raises(ProtocolError, match="pull before pushing again"):
            worker.push().result()


def test_a_job_larger_than_the_server_capacity_is_refused() -> None:
    from tensorwire.errors import CapacityExceeded

    with ServerThread(extensions=[ParamServer(capacity=1024)]) as server:
        with pytest.raises(CapacityExceeded, match="exceed 1024"):
            Worker(small_model(), [server.url], "async", SGD(), rank=0, world_size=1).start()
        assert server_stats([server.url])[0]["shards"] == 0  # nothing was kept


class Branchy(torch.nn.Module):
    """A model whose auxiliary head is used on some steps only: on the others it has no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(20, 5)
        self.aux = torch.nn.Linear(20, 5)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out + self.aux(x) if step % 3 == 0 else out


@pytest.mark.parametrize(
    "spec", [SGD(lr=0.1, momentum=0.9, weight_decay=1e-2), AdamW(lr=1e-2)], ids=["sgd-momentum", "adamw"]
)
def test_parameters_without_a_gradient_are_left_alone_as_torch_does(
    spec: OptimizerSpec, data: tuple[torch.Tensor, torch.Tensor]
) -> None:
    x, y = data
    steps = 30
    expected = Branchy()
    optimizer = spec.build(expected.parameters())  # type: ignore[arg-type]
    for step in range(steps):
        rows = slice(step * W * B, (step + 1) * W * B)
        optimizer.zero_grad()
        loss_of_branchy = F.cross_entropy(expected(x[rows], step), y[rows])
        loss_of_branchy.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    models = [Branchy() for _ in range(W)]

    def work(rank: int) -> None:
        with Worker(models[rank], urls, "sync", spec, rank=rank, world_size=W) as worker:
            for step in range(steps):
                rows = slice(step * W * B + rank * B, step * W * B + (rank + 1) * B)
                F.cross_entropy(models[rank](x[rows], step), y[rows]).backward()  # type: ignore[no-untyped-call]
                worker.step()

    with cluster(2) as urls:
        run_threads(work, W, DEADLINE)
    assert max_diff(models[0], expected) <= 1e-5


def raw_call(url: str, opcode: int, body: bytes, data: list[memoryview] | None = None) -> None:
    """One hand-made request on a connection of its own."""
    from tensorwire import transport as transports
    from tensorwire._aio import run
    from tensorwire.types import Address

    async def call() -> None:
        options = transports.TransportOptions(5.0, 10.0)
        conn = await transports.open_transport(Address.parse(url), options)
        try:
            assert isinstance(conn, FramedTransport)
            await conn.call(opcode, body, data or [], what="a hand-made request")
        finally:
            await conn.close()

    run(call())


def test_a_lying_world_in_ps_init_changes_nothing() -> None:
    from tensorwire.types import TensorMeta
    from tensorwire.wire import meta as wm
    from tensorwire.wire import ps as wps
    from tensorwire.wire.frame import Opcode

    config = '{"mode": "async", "optimizer": {"kind": "sgd"}}'
    metas = [TensorMeta("w#0:4", torch.float32, (4,), 16)]
    body = wps.PsHead(0, 1 << 23, job="t").encode() + wps.encode_config(config) + wm.encode_records(metas)
    with cluster(1) as urls:
        with pytest.raises(ProtocolError, match="not a valid rank"):
            raw_call(urls[0], Opcode.PS_INIT, body, [memoryview(torch.zeros(4).numpy()).cast("B")])
        (stats,) = server_stats(urls)
        assert stats["world"] == 0 and stats["shards"] == 0
        with Worker(small_model(), urls, "async", SGD(), rank=0, world_size=1):
            pass  # a real worker still creates the job


def test_ssp_refuses_a_push_staler_than_its_bound() -> None:
    model = small_model()
    x, y = torch.randn(B, 20), torch.randint(0, 5, (B,))
    with cluster(1) as urls, Worker(model, urls, "ssp:1", SGD(), rank=0, world_size=1) as worker:
        for _ in range(2):  # pushes at clocks 0 and 1 on parameters read at clock 0: within 1
            loss_of(model, x, y).backward()  # type: ignore[no-untyped-call]
            worker.push().result()
        loss_of(model, x, y).backward()  # type: ignore[no-untyped-call]
        with pytest.raises(ProtocolError, match="staler than ssp:1"):
            worker.push().result()


def test_a_second_process_cannot_take_a_live_rank() -> None:
    from tensorwire.errors import WaitTimeout

    with cluster(1) as urls, Worker(small_model(), urls, "sync", SGD(), rank=0, world_size=2):
        with pytest.raises(WaitTimeout, match="rank 0 to be freed"):  # it waits for the first to go
            Worker(small_model(), urls, "sync", SGD(), rank=0, world_size=2, timeout=0.5).start()
        (stats,) = server_stats(urls)
        assert stats["workers"]["0"]["live"]  # the refused one's exit did not remove the real one


def test_a_reader_that_never_reads_does_not_stall_training() -> None:
    """An observer asks for 64 MiB of parameters and reads none of it; training goes on."""
    import socket

    from tensorwire.wire import meta as wm
    from tensorwire.wire import ps as wps
    from tensorwire.wire.checksum import ChecksumKind
    from tensorwire.wire.frame import Header, Opcode, encode_frame_head

    model = torch.nn.Linear(4096, 4096)  # 64 MiB: more than any socket buffers hold
    x = torch.randn(2, 4096)
    with cluster(1) as urls, Worker(model, urls, "async", SGD(lr=1e-3), rank=0, world_size=1) as worker:
        host, port = urls[0].removeprefix("tcp://").rsplit(":", 1)
        keys = [s.key for s in worker.placement.on_server(0)]
        meta = wps.PsHead(wps.OBSERVER, job=worker.job).encode() + wm.encode_names(keys)
        frame = encode_frame_head(
            Header(1, Opcode.PS_PULL, 0, ChecksumKind.XXH3_64, 1, len(meta), 4 << 20, 0), meta
        )
        with socket.create_connection((host, int(port))) as stalled:
            stalled.sendall(frame)
            wait_for(lambda: server_stats(urls)[0]["pulls_sending"] == 1, 30, "the stalled pull's answer")
            for _ in range(3):
                model(x).pow(2).mean().backward()  # type: ignore[no-untyped-call]
                worker.step()
            assert worker.stats()[0]["version"] == 3


def test_a_model_smaller_than_the_cluster_leaves_servers_out() -> None:
    model = torch.nn.Linear(1, 1, bias=False)  # one element, two servers
    with cluster(2) as urls, Worker(model, urls, "sync", SGD(lr=0.5), rank=0, world_size=1) as worker:
        model(torch.ones(1, 1)).sum().backward()  # type: ignore[no-untyped-call]
        worker.step()
        assert sum(s["shards"] for s in server_stats(urls)) == 1


def test_unusable_optimizer_settings_are_refused_where_they_are_written() -> None:
    with pytest.raises(ValueError, match="unusable sgd settings"):
        SGD(lr=-1.0)
    with pytest.raises(ValueError, match="unusable sgd settings"):
        SGD(nesterov=True)  # nesterov needs momentum
