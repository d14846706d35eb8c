"""The parameter server and the gradient exchange with a model on a CUDA device: pinned staging,
the side stream, codecs and error feedback on the device. Skipped without a device; `make
gpu-check` runs them (``-m cuda``). Their pipeline runs on the CPU in test_ps_device.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from device_kit import cluster

from tensorwire.client.staging import CudaCopier
from tensorwire.compression import codec_for
from tensorwire.ps import SGD, ParamServer, Worker
from tensorwire.ps.exchange.client import ExchangeClient
from tensorwire.server import ServerThread
from tensorwire.testing.process import run_threads

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)"),
]

W, B, STEPS = 2, 16, 40
DEADLINE = 120.0


@pytest.fixture(autouse=True)
def _fp32_matmuls() -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # sums compared to 1e-5
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def model_on(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    return model.to(device)


def data(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    n = STEPS * W * B
    return torch.randn(n, 32, generator=gen).to(device), torch.randint(0, 10, (n,), generator=gen).to(device)


def train(urls: list[str], device: str, stream: bool = False, **options: object) -> list[torch.nn.Module]:
    x, y = data(device)
    models = [model_on(device) for _ in range(W)]

    def work(rank: int) -> None:
        side = torch.cuda.Stream() if stream else None  # type: ignore[no-untyped-call]
        with (
            torch.cuda.stream(side) if side is not None else contextlib.nullcontext(),
            Worker(
                models[rank],
                urls,
                "sync",
                SGD(lr=0.1, momentum=0.9),
                rank=rank,
                world_size=W,
                split_bytes=4096,
                **options,
            ) as worker,  # type: ignore[arg-type]  # fmt: skip
        ):
            for step in range(STEPS):
                rows = slice(step * W * B + rank * B, step * W * B + (rank + 1) * B)
                F.cross_entropy(models[rank](x[rows]), y[rows]).backward()  # type: ignore[no-untyped-call]
                worker.step()
            staging = worker._tensors.staging
            if device == "cuda":
                assert staging is not None and isinstance(staging.copier, CudaCopier)
                assert all(a.buffer.is_pinned() for a in staging.arenas.values())
                if worker.feedback is not None:
                    assert all(r.is_cuda for r in worker.feedback.residuals.values())
        torch.cuda.synchronize()

    run_threads(work, W, DEADLINE)
    return models


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max(float((p.detach().cpu() - q.detach().cpu()).abs().max()) for p, q in pairs)


def test_a_cuda_model_through_two_servers_matches_one_gpu_at_the_combined_batch() -> None:
    x, y = data("cuda")
    single = model_on("cuda")
    optimizer = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        rows = slice(step * W * B, (step + 1) * W * B)
        optimizer.zero_grad()
        F.cross_entropy(single(x[rows]), y[rows]).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    with cluster(2) as urls:
        models = train(urls, "cuda")
    assert all(p.is_cuda for p in models[0].parameters())
    assert max_diff(models[0], models[1]) == 0
    assert max_diff(models[0], single) <= 1e-5
    assert max_diff(models[0], model_on("cuda")) > 1e-2  # it trained


def test_training_under_a_stream_of_its_own_matches_the_default_stream() -> None:
    with cluster(2) as urls:
        default = train(urls, "cuda")
    with cluster(2) as urls:
        side = train(urls, "cuda", stream=True)
    assert max_diff(default[0], side[0]) == 0


def test_codecs_and_error_feedback_run_on_the_device_and_train_as_on_the_cpu() -> None:
    codecs = {"push_codec": "int8", "pull_codec": "bf16"}
    with cluster(2) as urls:
        on_gpu = train(urls, "cuda", **codecs)
    with cluster(2) as urls:
        on_cpu = train(urls, "cpu", **codecs)
    # The same codecs and error feedback; the gradients' float sums differ in their last bits, which
    # can move an int8 rounding by one step now and then (feedback carries it to the next step).
    assert max_diff(on_gpu[0], on_cpu[0]) <= 5e-3


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "int8:stochastic", "sign", "topk:0.05+fp16"])
def test_a_codec_encodes_and_decodes_on_the_device(name: str) -> None:
    codec = codec_for(name)
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(3))
    payload = codec.encode(x.cuda())
    assert payload.is_cuda and payload.numel() == codec.payload_bytes(x.numel())
    on_gpu = codec.decode(payload, torch.empty_like(x, device="cuda")).cpu()
    on_cpu = codec.decode(codec.encode(x), torch.empty_like(x))
    if name == "int8:stochastic":  # its noise differs: both within one quantisation step
        assert (on_gpu - x).abs().max() <= x.abs().max() / 127 * 1.01
    else:
        assert torch.allclose(on_gpu, on_cpu, rtol=1e-6, atol=1e-6)
    assert torch.equal(codec.decode(payload.cpu(), torch.empty_like(x)), on_gpu)  # a server decodes it alike


def test_the_exchange_averages_cuda_tensors_in_place() -> None:
    def grads(rank: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(rank)
        return {"w": torch.randn(1024, 1024, generator=gen), "b": torch.randn(1024, generator=gen)}

    want = {k: (grads(0)[k] + grads(1)[k]) / 2 for k in ("w", "b")}
    got: dict[int, dict[str, torch.Tensor]] = {}
    with ServerThread(extensions=[ParamServer(30.0)]) as server:

        def work(rank: int) -> None:
            with ExchangeClient(server.url, rank=rank, world_size=2) as client:
                g = {k: v.cuda() for k, v in grads(rank).items()}
                where = {k: v.data_ptr() for k, v in g.items()}
                assert client.allreduce(g) == 2
                assert {k: v.data_ptr() for k, v in g.items()} == where and all(v.is_cuda for v in g.values())
                got[rank] = {k: v.cpu() for k, v in g.items()}  # read at once: ordered by the event

        run_threads(work, 2, DEADLINE)
    for rank in range(2):
        assert all(torch.allclose(got[rank][k], want[k], atol=1e-6) for k in want)
