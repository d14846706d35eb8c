"""tensorwire as vLLM's weight-transfer backend, against real CPU engines: an engine started on
weights A and updated to B through tensorwire generates exactly what a fresh engine on B does
(tokens and logprobs, float32), reports B's version, survives 20 updates in a row, refuses a
corrupt generation and keeps serving, keeps the last complete generation when a trainer dies
mid-publish, catches up by itself when restarted, and two engines read one update through the
relay (the store sends the model about once)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

# These run in the engines' own environment (`make test-engines` makes .venv-engines); without
# vLLM (`make test`'s .venv) the module is skipped, so the main environment stays small.
pytest.importorskip("vllm", reason="needs vLLM: `make test-engines` runs tests/engines in .venv-engines")

from vllm import LLM, SamplingParams
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

import tensorwire
import tensorwire.vllm
from tensorwire.bench.engine_models import build_llama, engine_args
from tensorwire.broadcast.coordinator import RelayCoordinator
from tensorwire.errors import WeightUpdateFailed
from tensorwire.server.options import ServerOptions
from tensorwire.vllm import Engines, TensorwireTrainerInitInfo
from tensorwire.vllm.engine import PREFIX_ENV, URL_ENV
from tensorwire.vllm.layout import VERSION_KEY
from tensorwire.vllm.publisher import version_record

TOKEN = "engines-token"
PREFIX = "policy"
PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [7, 100, 42]}]
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=3, detokenize=False)

pytestmark = pytest.mark.timeout(600)


def outputs(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each prompt's greedy tokens and, per token, its top logprobs (exact floats)."""
    done = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
        )
        for o in done
    ]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("weights")
    return {
        "a": root / "a",
        "b": root / "b",
        "model_a": build_llama(root / "a", 1),
        "model_b": build_llama(root / "b", 2),
    }


@pytest.fixture(scope="module")
def store() -> Iterator[tensorwire.ServerThread]:
    with tensorwire.ServerThread(
        ["tcp://127.0.0.1:0"], ServerOptions(token=TOKEN), store=tensorwire.TensorStore(1 << 30)
    ) as srv:
        RelayCoordinator.of(srv.server)  # as `tensorwire serve` does: readers of a generation relay it
        yield srv


@pytest.fixture(scope="module", autouse=True)
def engine_token() -> Iterator[None]:
    """The engines' credential comes from their own environment, never from the trainer."""
    os.environ["TENSORWIRE_TOKEN"] = TOKEN
    yield
    os.environ.pop("TENSORWIRE_TOKEN", None)


@pytest.fixture(scope="module")
def fresh_b(weights: dict[str, Any]) -> list[Any]:
    """What an engine started on B generates: the reference every update to B must equal."""
    llm = LLM(**engine_args(weights["b"]))
    try:
        return outputs(llm)
    finally:
        stop(llm)


@pytest.fixture(scope="module")
def engine(weights: dict[str, Any], fresh_b: list[Any]) -> Iterator[LLM]:
    llm = LLM(**engine_args(weights["a"]))
    yield llm
    stop(llm)


@pytest.fixture(scope="module")
def fresh_a(engine: LLM) -> list[Any]:
    """What the engine generated on A, its checkpoint, before any update (taken first: see
    the first test)."""
    return outputs(engine)


def stop(llm: LLM) -> None:
    """End an engine's processes (its engine core and workers) now, not at garbage collection."""
    llm.llm_engine.engine_core.shutdown()


def sender(store: tensorwire.ServerThread, llms: list[LLM], model: torch.nn.Module, **options: Any) -> Any:
    info = TensorwireTrainerInitInfo(rank=0, url=store.url, prefix=PREFIX, token=TOKEN, **options)
    return WeightTransferTrainerFactory.trainer_init(info, client=Engines(llms), source=ModuleSource(model))


def test_an_update_to_b_generates_what_an_engine_started_on_b_does(
    engine: LLM,
    weights: dict[str, Any],
    fresh_a: list[Any],
    fresh_b: list[Any],
    store: tensorwire.ServerThread,
) -> None:
    assert fresh_a != fresh_b  # A and B differ, so the comparison below can fail
    trainer = sender(store, [engine], weights["model_b"])
    generation = trainer.send_weights(version="step-b")
    assert outputs(engine) == fresh_b
    assert engine.get_weight_version() == "step-b"
    assert generation >= 1
    trainer.shutdown()


def test_twenty_updates_in_a_row_end_on_the_last(
    engine: LLM, weights: dict[str, Any], fresh_b: list[Any], store: tensorwire.ServerThread
) -> None:
    model = weights["model_b"]
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = sender(store, [engine], model)
    try:
        for _ in range(19):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            generation = trainer.send_weights()
            assert engine.get_weight_version() == str(generation)
        assert outputs(engine) != fresh_b
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
        last = trainer.send_weights(version="back-to-b")
        assert outputs(engine) == fresh_b
        assert engine.get_weight_version() == "back-to-b"
        assert last == generation + 1
    finally:
        trainer.shutdown()


def test_a_corrupt_generation_is_refused_and_the_engine_keeps_serving(
    engine: LLM, weights: dict[str, Any], fresh_b: list[Any], store: tensorwire.ServerThread
) -> None:
    """A chunk whose bytes differ from the checksum the store computed at publish (a bit flipped
    in the store's memory) is refused: the update fails naming the generation, the engine's
    outputs and version are those of the last good update. (Without prefetch: a prefetching
    engine could read the generation before the bit is flipped, and rightly apply it.)"""
    trainer = sender(store, [engine], weights["model_b"], prefetch=False)
    try:
        trainer.send_weights(version="good")
        served = outputs(engine)
        published = trainer.publisher.publish(ModuleSource(weights["model_a"]), "corrupt")
        flip_a_byte(store, f"{PREFIX}/model.layers.0.mlp.down_proj.weight", published.number)
        with pytest.raises(WeightUpdateFailed, match=f"generation {published.number}"):
            trainer.apply(published.number, "corrupt")
        assert outputs(engine) == served
        assert engine.get_weight_version() == "good"
    finally:
        trainer.shutdown()


def flip_a_byte(store: tensorwire.ServerThread, name: str, number: int) -> None:
    """Flip one bit of ``name`` as the store keeps it in generation ``number``."""
    generations = store.server.generations
    kept = generations.find(PREFIX, number)
    _, data = kept.tensors[name]
    data[data.nbytes // 2] ^= 1


def test_an_engine_reads_a_generation_as_it_is_published_and_the_update_only_applies_it(
    engine: LLM,
    weights: dict[str, Any],
    fresh_a: list[Any],
    fresh_b: list[Any],
    store: tensorwire.ServerThread,
) -> None:
    """With prefetch (the default) the engine brings a generation into staging when the store
    announces it, while it keeps serving; the update that applies it then moves no data."""
    trainer = sender(store, [engine], weights["model_b"])
    try:
        trainer.send_weights(version="b-again")
        assert outputs(engine) == fresh_b
        served = store.server.status()["relay"]["served_bytes"][PREFIX]
        published = trainer.publisher.publish(ModuleSource(weights["model_a"]), "a-prefetched")
        deadline = time.monotonic() + 60
        while store.server.status()["relay"]["served_bytes"][PREFIX] - served < published.nbytes:
            assert time.monotonic() < deadline, "the engine did not read the new generation by itself"
            time.sleep(0.05)
        assert outputs(engine) == fresh_b  # read, not applied: still serving b-again
        read = store.server.status()["relay"]["served_bytes"][PREFIX]
        trainer.apply(published.number, "a-prefetched")
        assert store.server.status()["relay"]["served_bytes"][PREFIX] == read  # the apply moved nothing
        assert outputs(engine) == fresh_a
        assert engine.get_weight_version() == "a-prefetched"
    finally:
        trainer.shutdown()


PART_OF_A = """
import sys
from safetensors.torch import load_file
from tensorwire.vllm.publisher import PublisherOptions, WeightPublisher

url, prefix, folder = sys.argv[1:4]
weights = load_file(folder + "/model.safetensors")
options = PublisherOptions(url, prefix, rank=0, world_size=2, run_id="killed", part_timeout=300.0)
WeightPublisher(options).publish(weights.items(), "never-complete")  # waits for rank 1, which never comes
"""


def test_a_trainer_killed_mid_publish_leaves_the_engines_on_the_last_complete_generation(
    engine: LLM, weights: dict[str, Any], store: tensorwire.ServerThread
) -> None:
    """A trainer rank SIGKILLed while its generation is open (its part sent or being sent, the
    other rank's not): no engine ever sees any of it; catching up finds the last complete one."""
    trainer = sender(store, [engine], weights["model_b"])
    try:
        trainer.send_weights(version="last-complete")
    finally:
        trainer.shutdown()
    served = outputs(engine)
    parts = store.server.part_publishes
    proc = subprocess.Popen(
        [sys.executable, "-c", PART_OF_A, store.url, PREFIX, str(weights["a"])],
        env={**os.environ, "TENSORWIRE_TOKEN": TOKEN},
    )
    try:
        deadline = time.monotonic() + 60
        while not parts.open:
            assert proc.poll() is None, f"the publishing trainer ended on its own ({proc.returncode})"
            assert time.monotonic() < deadline, "the trainer's part never reached the store"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert tensorwire.vllm.catch_up(engine, store.url, PREFIX, token=TOKEN) == "last-complete"
    assert outputs(engine) == served
    assert engine.get_weight_version() == "last-complete"


@pytest.fixture(scope="module")
def restarted(weights: dict[str, Any], store: tensorwire.ServerThread) -> Iterator[LLM]:
    """An engine started (from A's checkpoint) while the run is on B: configured on its own side,
    by its environment, with no trainer calling it."""
    with tensorwire.connect(store.url, token=TOKEN) as client:
        client.publish(PREFIX, {**weights["model_b"].state_dict(), VERSION_KEY: version_record("restart-b")})
    os.environ[URL_ENV], os.environ[PREFIX_ENV] = store.url, PREFIX
    try:
        llm = LLM(**engine_args(weights["a"]))
    finally:
        os.environ.pop(URL_ENV), os.environ.pop(PREFIX_ENV)
    yield llm
    stop(llm)


def test_an_engine_restarted_mid_run_catches_up_by_itself(
    restarted: LLM, fresh_b: list[Any], store: tensorwire.ServerThread
) -> None:
    assert outputs(restarted) == fresh_b  # B, brought in as it started
    assert restarted.get_weight_version() != "restart-b"  # vLLM's own, until catch_up sets it
    assert tensorwire.vllm.catch_up(restarted, store.url, PREFIX) == "restart-b"
    assert restarted.get_weight_version() == "restart-b"
    assert outputs(restarted) == fresh_b


def test_an_engine_configured_on_its_side_reads_no_other_store_or_prefix(
    restarted: LLM, store: tensorwire.ServerThread
) -> None:
    """Its environment named the store and the prefix: a trainer's init naming another store (to
    which the engine would send its host's token) or another prefix is refused, and it still
    reads where it was configured to."""
    for init in ({"url": "tcp://127.0.0.1:9", "prefix": PREFIX}, {"url": store.url, "prefix": "other"}):
        with pytest.raises(Exception, match="this engine reads only"):
            restarted.init_weight_transfer_engine({"init_info": init})
    assert tensorwire.vllm.catch_up(restarted, store.url, PREFIX) == "restart-b"


def test_two_engines_read_one_update_through_the_relay(
    engine: LLM, restarted: LLM, weights: dict[str, Any], fresh_a: list[Any], store: tensorwire.ServerThread
) -> None:
    """Every weight changes (B to A, as a full fine-tuning step does): a delta would cost the
    store the model once per engine, so both read through the relay, the second from the first."""
    model = weights["model_a"]
    size = sum(p.nbytes for p in model.parameters())
    served = store.server.status()["relay"]["served_bytes"].get(PREFIX, 0)
    trainer = sender(store, [engine, restarted], model)
    try:
        trainer.send_weights(version="both-a")
    finally:
        trainer.shutdown()
    egress = store.server.status()["relay"]["served_bytes"][PREFIX] - served
    assert size <= egress <= 1.1 * size + (1 << 16), (egress, size)
    assert outputs(engine) == outputs(restarted) == fresh_a
    assert engine.get_weight_version() == restarted.get_weight_version() == "both-a"
