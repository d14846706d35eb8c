"""A model "on a device" in the parameter server and the gradient exchange, on the CPU: the CUDA
path's staging (pinned buffers, pieces in flight, buffers reused, the event the training thread
waits on) with ``device_kit.LateCopier`` standing in for the device, as the put/get staging's tests
stand ``HostCopier`` in (test_fast_paths.py). On a GPU, test_ps_cuda.py runs the real thing."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import torch.nn.functional as F
from device_kit import LateCopier, cluster

from tensorwire.client.staging import HostArena, HostCopier, StagedSegments, stage_out
from tensorwire.errors import InvalidTensor
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.exchange.client import ExchangeClient
from tensorwire.ps.placement import ParamSpec, plan
from tensorwire.ps.worker.device import DeviceStaging, device_of
from tensorwire.ps.worker.shards import ModelShards, check_trainable
from tensorwire.server import ServerThread
from tensorwire.testing.process import run_threads

W, B, STEPS = 2, 8, 30
DEADLINE = 60.0


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))


def train(urls: list[str], copiers: list[LateCopier] | None, codecs: dict[str, str]) -> list[torch.nn.Module]:
    """W workers in sync mode, each with its own stand-in device (or none: the CPU path)."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(STEPS * W * B, 20, generator=gen), torch.randint(0, 5, (STEPS * W * B,), generator=gen)
    models = [small_model() for _ in range(W)]

    def work(rank: int) -> None:
        # 512-byte pieces: every push is several pieces; split_bytes cuts the weight into ranges
        staging = DeviceStaging(copiers[rank], piece_bytes=512) if copiers else None
        with Worker(models[rank], urls, "sync", SGD(lr=0.1, momentum=0.9), rank=rank, world_size=W,
                    split_bytes=1024, staging=staging, **codecs) as worker:  # type: ignore[arg-type]  # fmt: skip
            for step in range(STEPS):
                rows = slice(step * W * B + rank * B, step * W * B + (rank + 1) * B)
                F.cross_entropy(models[rank](x[rows]), y[rows]).backward()  # type: ignore[no-untyped-call]
                worker.step()
            if staging is not None:
                assert worker._tensors.staging is staging
                assert len(staging.arenas) == len(urls)  # one buffer per server, kept
                assert all(a.grown <= 2 for a in staging.arenas.values())  # reused, not made each step

    run_threads(work, W, DEADLINE)
    return models


@pytest.mark.parametrize(
    "codecs", [{}, {"push_codec": "int8", "pull_codec": "bf16"}], ids=["raw", "int8-push-bf16-pull"]
)
def test_a_worker_on_a_stand_in_device_trains_bit_identically_to_a_cpu_one(codecs: dict[str, str]) -> None:
    with cluster(2) as urls:
        plain = train(urls, None, codecs)
    copiers = [LateCopier(delay=0.0002) for _ in range(W)]
    try:
        with cluster(2) as urls:
            staged = train(urls, copiers, codecs)
    finally:
        for c in copiers:
            c.close()
    for a, b in zip(plain[0].parameters(), staged[0].parameters(), strict=True):
        assert torch.equal(a, b)  # bit for bit: no byte read early, no buffer reused too soon
    trained = zip(plain[0].parameters(), small_model().parameters(), strict=True)
    assert any(not torch.equal(a, b) for a, b in trained)
    for copier in copiers:
        assert copier.pending() == 0
        assert ("compute_waits", -1) not in copier.log
        assert any(what == "compute_waited" for what, _ in copier.log)  # pulls waited on by handle


@pytest.mark.parametrize("codec", [None, "topk:0.1"], ids=["raw", "topk-error-feedback"])
def test_an_exchange_on_a_stand_in_device_averages_bit_identically(codec: str | None) -> None:
    def grads(rank: int, step: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 * rank + step)
        return {"w": torch.randn(300, 70, generator=gen), "b": torch.randn(70, generator=gen)}

    def run(urls: list[str], staged: bool) -> dict[int, list[dict[str, torch.Tensor]]]:
        out: dict[int, list[dict[str, torch.Tensor]]] = {}

        def work(rank: int) -> None:
            copier = LateCopier(delay=0.0002) if staged else None
            staging = DeviceStaging(copier, piece_bytes=4096) if copier else None
            try:
                with ExchangeClient(urls, rank=rank, world_size=2, codec=codec, staging=staging,
                                    piece_bytes=16 << 10) as client:  # fmt: skip
                    out[rank] = []
                    for step in range(4):
                        g = grads(rank, step)
                        assert client.allreduce(g) == 2
                        out[rank].append({k: v.clone() for k, v in g.items()})  # read at once
                        if staging is not None and codec is not None:
                            assert client.feedback is not None and client.feedback.residuals
            finally:
                if copier is not None:
                    copier.close()

        run_threads(work, 2, DEADLINE)
        return out

    with cluster(2) as urls:  # two servers, pieces of 16 KiB: several requests, each staged
        plain = run(urls, staged=False)
    with cluster(2) as urls:
        staged = run(urls, staged=True)
    for rank in range(2):
        for a, b in zip(plain[rank], staged[rank], strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_exchange_stages_each_request_in_its_own_reused_buffer_and_is_waited_on_by_event() -> None:
    """A step of many requests over two servers (1 MiB of means in pieces of up to 64 KiB, staged
    in 4 KiB copies that run late and poison): no piece is read before its copy ended, the means
    are copied back in place and the training thread's stream waits for the last one by event
    (held until it does: a loop that waited for it, a full synchronize, would hang); each request
    keeps its own pinned buffer, reused the next step."""
    copier = LateCopier(delay=0.00005)
    x = torch.randn(256 << 10)
    sent = x.clone()
    servers = [ServerThread(extensions=[ParamServer(30.0)]) for _ in range(2)]
    try:
        staging = DeviceStaging(copier, piece_bytes=4096)
        urls = [s.url for s in servers]
        with ExchangeClient(urls, rank=0, world_size=1, staging=staging, piece_bytes=64 << 10) as client:
            assert client.allreduce({"x": x}) == 1
            first = len(copier.log)
            pinned, arenas = staging.pinned_bytes, len(staging.arenas)
            assert client.allreduce({"x": x}) == 1
    finally:
        copier.close()
        for server in servers:
            server.close()
    assert torch.equal(x, sent)  # the mean over one worker: itself, every byte back in place
    requests = len(client._plan_cache.requests) if client._plan_cache else 0
    assert requests > 8 and arenas == requests  # one buffer per request, all staged at once
    assert staging.pinned_bytes == pinned >= x.numel() * 4  # reused the second step, not grown
    log = copier.log
    done = {n: i for i, (what, n) in enumerate(log) if what == "done"}
    for i, (what, n) in enumerate(log):
        if what == "waited":
            assert done[n] < i  # nothing read before its copy completed
    waits = [n for what, n in log[first:] if what == "compute_waits"]
    assert len(waits) == 1  # one event wait for the step's landings (the last copy back)
    (last,) = waits
    assert log.index(("compute_waits", last)) < log.index(("compute_waited", last))
    assert max(n for what, n in log if what == "start") == last  # the last copy started is the one


def test_a_buffer_is_handed_out_again_only_once_the_copies_on_it_completed() -> None:
    async def go() -> None:
        copier = LateCopier()
        release = threading.Event()
        copier.gate(0, release)
        arena = HostArena(pin=False)
        try:
            host = await arena.claim(copier, 64)
            device = torch.zeros(64, dtype=torch.uint8)
            arena.last = copier.copy(device, host)  # a copy reading the buffer, not yet run
            claim = asyncio.ensure_future(arena.claim(copier, 64))
            for _ in range(20):
                await asyncio.sleep(0)
            assert not claim.done()  # held while the copy reading it has not run
            release.set()
            again = await asyncio.wait_for(claim, DEADLINE)
            assert again.data_ptr() == host.data_ptr() and arena.grown == 1  # the same buffer, reused
            assert copier.log[-2:] == [("done", 0), ("waited", 0)]
        finally:
            copier.close()

    asyncio.run(go())


def test_staged_segments_wait_for_the_pieces_a_read_needs_and_once_only() -> None:
    async def go() -> None:
        copier = LateCopier()
        sources = [torch.arange(1000, dtype=torch.float32), torch.arange(10, dtype=torch.float32)]
        host = torch.empty(4040, dtype=torch.uint8)
        try:
            staged = stage_out(copier, host, sources, piece_bytes=1024)
            assert [v.nbytes for v in staged] == [1024, 1024, 1024, 968]  # the small one shares a piece
            await staged.ready(1)
            assert [w for w in copier.log if w[0] == "waited"] == [("waited", 0)]
            await staged.ready(4040)
            await staged.ready(2000)  # already waited for: no second wait
            assert [w for w in copier.log if w[0] == "waited"] == [("waited", 0), ("waited", 4)]
            assert isinstance(staged, StagedSegments) and staged.last is not None
            assert bytes(b"".join(staged)) == b"".join(s.numpy().tobytes() for s in sources)
        finally:
            copier.close()

    asyncio.run(go())


def test_a_cpu_model_is_sent_from_and_lands_in_its_own_memory() -> None:
    """No staging, no copy: the push's data are views of the gradients, the pull's of the parameters."""
    model = small_model()
    params = dict(model.named_parameters())
    shards = ModelShards(params, plan(ParamSpec.of(model), 1), None, None, None)
    assert shards.staging is None
    grads = {n: torch.randn_like(p) for n, p in params.items()}

    def at(tensors: dict[str, torch.Tensor]) -> list[int]:
        return [tensors[s.param].data_ptr() + s.start * 4 for s in shards.placement.shards]

    async def go() -> None:
        _, data = await shards.push_data(shards.placement.shards, dict(grads), None, "s")
        assert type(data) is list
        assert [torch.frombuffer(d, dtype=torch.uint8).data_ptr() for d in data] == at(grads)
        into = await shards.pull_into(shards.placement.shards, "s")
        metas = [shards.meta(s) for s in shards.placement.shards]
        landing = [torch.frombuffer(v, dtype=torch.uint8).data_ptr() for v in into.sink(metas)]
        assert landing == at({n: p.data for n, p in params.items()})

    asyncio.run(go())


def test_models_the_staging_cannot_take_are_refused() -> None:
    with pytest.raises(InvalidTensor, match="CUDA"):
        check_trainable("w", torch.empty(3, device="meta"))
    with pytest.raises(InvalidTensor, match="several devices"):
        device_of([torch.empty(1), torch.empty(1, device="meta")], "the tensors")
    with pytest.raises(InvalidTensor, match="CPU or CUDA"):
        DeviceStaging.for_device(torch.device("meta"))
    assert DeviceStaging.for_device(torch.device("cpu")) is None
    assert HostArena(pin=None).pin == torch.cuda.is_available()
    with pytest.raises(ValueError):
        DeviceStaging(HostCopier(), piece_bytes=0)
