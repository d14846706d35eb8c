"""Compression through real loopback servers: digits trained with compressed pushes and pulls,
compressed pushes replicated bit-identically, weights pulled quantised while the server keeps
full precision, the gradient exchange (TCP and gRPC) with codecs, and hostile payloads refused."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import pytest
import torch
import torch.nn.functional as F

from tensorwire.compression import TopK, codec_for
from tensorwire.errors import InvalidTensor, ProtocolError
from tensorwire.ps import SGD, ParamServer, Worker, digits, pull_parameters
from tensorwire.ps.exchange.client import ExchangeClient
from tensorwire.security import Security
from tensorwire.server import ServerThread
from tensorwire.testing.process import run_threads
from tensorwire.v1 import gradient_service_pb2 as pb
from tensorwire.v1 import gradient_service_pb2_grpc as pb_grpc

# The digits job as `tensorwire bench compression` runs it: one worker, async, Adam 2e-3, 15 epochs.
CONFIG = digits.TrainConfig("async", epochs=15, batch=32, lr=2e-3, timeout=60)


@contextlib.contextmanager
def servers(count: int = 1) -> Iterator[list[str]]:
    threads = [ServerThread(extensions=[ParamServer(60, keep_jobs=True)]) for _ in range(count)]  # read after
    try:
        yield [t.url for t in threads]
    finally:
        for t in threads:
            t.close()


def train(push: str | None, pull: str | None = None, feedback: bool | None = None) -> tuple[float, int, int]:
    """(test accuracy of the server's weights, bytes pushed, bytes pulled) of one digits run."""
    config = digits.TrainConfig(**{**CONFIG.__dict__, "push_codec": push, "pull_codec": pull,
                                   "error_feedback": feedback})  # fmt: skip
    with servers(1) as urls:
        report = digits.train_worker(urls, config, rank=0, world_size=1)
        return digits.evaluate(urls), report.bytes_pushed, report.bytes_pulled


def test_digits_accuracy_with_topk_error_feedback_and_int8() -> None:
    """topk:0.01 with error feedback and int8 (pushes and pulls) land within a point of the
    uncompressed run; topk:0.01 without error feedback is measurably worse."""
    base, base_pushed, base_pulled = train(None)
    topk, topk_pushed, _ = train("topk:0.01")
    int8, int8_pushed, int8_pulled = train("int8", "int8")
    drift, _, _ = train("topk:0.01", feedback=False)
    assert base > 0.95
    assert abs(topk - base) <= 0.01, (topk, base)
    assert abs(int8 - base) <= 0.01, (int8, base)
    assert drift <= topk - 0.01, (drift, topk)  # 6 test images or more
    assert topk_pushed * 10 <= base_pushed
    assert int8_pushed * 3.9 <= base_pushed and int8_pulled * 3.9 <= base_pulled


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def steps(worker: Worker, model: torch.nn.Module, count: int) -> None:
    for step in range(count):
        x, y = batch(step)
        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        worker.step()


def test_compressed_pushes_reach_the_backup_bit_identical() -> None:
    backup_ps = ParamServer(standby=True, peer=Security(token="peer"))
    with ServerThread(extensions=[backup_ps]) as backup:
        primary_ps = ParamServer(backups=[backup.url], peer=Security(token="peer"))
        with ServerThread(extensions=[primary_ps]) as primary:
            model = digits.make_model()
            with Worker(model, f"{primary.url}|{backup.url}", "async", SGD(lr=0.1, momentum=0.9),
                        rank=0, push_codec="topk:0.05+int8:stochastic", heartbeat=0) as worker:  # fmt: skip
                steps(worker, model, 8)
            assert primary_ps.version == backup_ps.version == 8
            for key, shard in primary_ps.shards.items():
                assert torch.equal(shard.param.data, backup_ps.shards[key].param.data), key


def test_quantised_pulls_leave_the_server_in_full_precision() -> None:
    codec = codec_for("int8")
    with servers(2) as urls:
        model = digits.make_model()
        with Worker(model, urls, "async", SGD(lr=0.1), rank=0, pull_codec="int8", heartbeat=0) as worker:
            steps(worker, model, 3)
            exact = digits.make_model()
            pull_parameters(exact, urls)  # an observer pulls without a codec: the server's own values
            for (name, mine), theirs in zip(model.named_parameters(), exact.parameters(), strict=True):
                assert not torch.equal(mine, theirs), name  # quantised here ...
                for shard in worker.placement.shards_of(name):  # ... exactly as the codec rounds each shard
                    want = theirs.detach().view(-1)[shard.start : shard.stop]
                    got = mine.detach().view(-1)[shard.start : shard.stop]
                    assert torch.equal(got, codec.decode(codec.encode(want), torch.empty_like(want)))
            raw = sum(p.numel() * 4 for p in model.parameters())
            assert worker.bytes_pulled < 4 * raw * 0.26  # 4 pulls (the first one and 3 steps) in int8
    with pytest.raises(ValueError, match="drops elements"):
        Worker(model, "tcp://127.0.0.1:1", pull_codec="topk:0.1")


class _Broken(TopK):
    """A top-k whose payloads index past the tensor (what a hostile or buggy peer could send)."""

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        payload = super()._encode(flat)
        payload[:4].view(torch.int32)[0] = flat.numel() + 5
        return payload


class _Unknown(TopK):
    """A codec the server does not know."""

    def __init__(self) -> None:
        super().__init__(0.1)
        self.name = "topk:0.1+zip"


def test_bad_codecs_and_payloads_change_nothing() -> None:
    with servers(1) as urls:
        for codec, error in ((_Broken(0.1), InvalidTensor), (_Unknown(), ProtocolError)):
            model = digits.make_model()
            with Worker(model, urls, "async", rank=0, push_codec=codec, heartbeat=0, timeout=10) as worker:
                F.cross_entropy(model(batch(0)[0]), batch(0)[1]).backward()  # type: ignore[no-untyped-call]
                with pytest.raises(error):
                    worker.push().result()
                assert worker.stats()[0]["version"] == 0  # nothing applied; the server still answers
        model = digits.make_model()
        with Worker(model, urls, "async", rank=0, push_codec="int8", heartbeat=0) as worker:
            steps(worker, model, 1)
            assert worker.stats()[0]["version"] == 1


def grad_of(rank: int) -> torch.Tensor:
    return torch.randn(1000, generator=torch.Generator().manual_seed(rank))


def test_exchange_averages_compressed_gradients_over_tcp_and_grpc() -> None:
    """Rank 0 sends int8 over ALLREDUCE, rank 1 fp16 over gRPC (codec and numel in the metadata):
    the mean is that of the decoded gradients, for both."""
    got: dict[int, torch.Tensor] = {}
    with ServerThread(["tcp://127.0.0.1:0", "grpc://127.0.0.1:0"], extensions=[ParamServer(30)]) as server:
        url, target = (str(a) for a in server.addresses)

        def work(rank: int) -> None:
            grad = grad_of(rank)
            if rank == 0:
                with ExchangeClient(url, rank=0, world_size=2, codec="int8") as client:
                    client.allreduce({"w": grad})
                    assert client.bytes_sent == codec_for("int8").payload_bytes(1000)
                got[0] = grad
                return
            with grpc.insecure_channel(target.removeprefix("grpc://")) as channel:
                stub = pb_grpc.GradientServiceStub(channel)
                metadata = [("worker-id", "1"), ("step", "0"), ("tensor-name", "w"), ("world-size", "2"),
                            ("codec", "fp16"), ("numel", "1000")]  # fmt: skip
                request = pb.GradientRequest(gradient=codec_for("fp16").encode(grad).numpy().tobytes())
                reply = stub.UpdateGradient(request, metadata=metadata, timeout=30)
                got[1] = torch.frombuffer(bytearray(reply.updated_gradient), dtype=torch.float32)
                with pytest.raises(grpc.RpcError) as no_numel:
                    stub.UpdateGradient(request, metadata=metadata[:-1], timeout=30)
                assert no_numel.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        run_threads(work, 2, 60)
    decoded = [codec_for(c).decode(codec_for(c).encode(grad_of(r)), torch.empty(1000))
               for r, c in ((0, "int8"), (1, "fp16"))]  # fmt: skip
    want = (decoded[0] + decoded[1]) / 2
    assert torch.allclose(got[0], want, atol=1e-6) and torch.equal(got[0], got[1])


def test_sync_job_with_the_exact_codec_matches_an_uncompressed_one_bit_for_bit() -> None:
    """fp32 is a codec too (no feedback: it loses nothing): two sync workers through it end with
    the same bits as two workers pushing raw gradients."""
    finals = []
    for codec in (None, "fp32"):
        models = [digits.make_model() for _ in range(2)]
        with servers(2) as urls:

            def work(rank: int, models: list[torch.nn.Module] = models, codec: str | None = codec) -> None:
                with Worker(models[rank], urls, "sync", SGD(lr=0.1, momentum=0.9), rank=rank, world_size=2,
                            push_codec=codec, heartbeat=0) as worker:  # fmt: skip
                    assert worker.feedback is None
                    for step in range(5):
                        x, y = batch(10 * step + rank)
                        F.cross_entropy(models[rank](x), y).backward()  # type: ignore[no-untyped-call]
                        worker.step()

            run_threads(work, 2, 60)
        finals.append([p.detach() for p in models[0].parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
