"""An engine's weight reader against generations that do not fit its model, stores that lie or
stall, and trainers that fail mid-publish (tensorwire.vllm: reader.py, layout.py, publisher.py).

A generation is checked against the model's reference on its manifest, so one that does not fit
is refused before a byte of it moves; a chunk whose bytes changed in the store is refused; a
reader reads only its own prefix, only with the store's token, and within its timeout; a
multi-part publish that loses a part leaves the previous generation the newest. Real servers on
loopback; nothing here imports vLLM.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import tensorwire
from tensorwire.broadcast.coordinator import RelayCoordinator
from tensorwire.errors import (
    AuthenticationError,
    CorruptFrame,
    DigestMismatch,
    LayoutMismatch,
    PublishAborted,
    TensorwireError,
    WaitTimeout,
)
from tensorwire.server.options import ServerOptions
from tensorwire.vllm import layout
from tensorwire.vllm.layout import MAX_VERSION_BYTES, VERSION_KEY, Reference
from tensorwire.vllm.publisher import PublisherOptions, WeightPublisher
from tensorwire.vllm.reader import Brought, ReaderOptions, WeightReader

TOKEN = "engine-and-trainer-share-this"
PREFIX = "policy"


def model(seed: int) -> dict[str, torch.Tensor]:
    """A small model's checkpoint-format weights (under 1 KB)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=gen),
        "head.weight": torch.randn(4, 8, generator=gen),
        "head.bias": torch.randn(4, generator=gen),
    }


REFERENCE = layout.from_tensors(model(0).items(), "a test model")


@contextmanager
def store() -> Iterator[tensorwire.ServerThread]:
    """A store with a token that relays its generations, as ``tensorwire serve`` does."""
    options = ServerOptions(token=TOKEN)
    with tensorwire.ServerThread(
        ["tcp://127.0.0.1:0"], options, store=tensorwire.TensorStore(1 << 28)
    ) as srv:
        RelayCoordinator.of(srv.server)
        yield srv


def publish(srv: tensorwire.ServerThread, tensors: dict[str, torch.Tensor], prefix: str = PREFIX) -> int:
    with tensorwire.connect(srv.url, token=TOKEN) as client:
        return client.publish(prefix, tensors).number


def reader(
    srv: tensorwire.ServerThread, reference: Reference = REFERENCE, *, verify: bool = False
) -> WeightReader:
    return WeightReader(ReaderOptions(srv.url, PREFIX, token=TOKEN, timeout=10.0, verify=verify), reference)


def relayed(srv: tensorwire.ServerThread) -> tuple[set[str], int]:
    """The relay requests the store answered, and the data bytes it sent for them."""
    rows = list(srv.server.counts.rows.items())
    ops = {op for (op, _), _row in rows if op.startswith("relay_")}
    return ops, sum(row.sent for (op, _), row in rows if op.startswith("relay_"))


def same(brought: Brought, weights: dict[str, torch.Tensor]) -> bool:
    return brought.weights.keys() == weights.keys() and all(
        torch.equal(brought.weights[k], weights[k]) for k in weights
    )


def refused_unread(srv: tensorwire.ServerThread, tensors: dict[str, torch.Tensor], naming: str) -> None:
    """A fresh reader refuses the generation ``tensors`` with LayoutMismatch naming ``naming``,
    having allocated no staging, made no Subscriber and pulled nothing from the store."""
    publish(srv, tensors)
    weights = reader(srv)
    try:
        with pytest.raises(LayoutMismatch, match=naming):
            weights.bring("latest")
        assert weights.staging == {} and weights._subscriber is None
    finally:
        weights.close()
    assert relayed(srv) == (set(), 0)


# -- 1. names, shapes and dtypes -------------------------------------------------------------------
def test_an_extra_name_is_refused_before_anything_is_read() -> None:
    with store() as srv:
        refused_unread(srv, {**model(1), "lm_head.weight": torch.zeros(4, 8)}, "'lm_head.weight'")


def test_a_missing_name_is_refused_before_anything_is_read() -> None:
    weights = model(1)
    del weights["head.weight"]
    with store() as srv:
        refused_unread(srv, weights, "lacks 'head.weight'")


def test_one_shape_that_differs_is_refused_before_anything_is_read() -> None:
    with store() as srv:
        refused_unread(srv, {**model(1), "head.weight": torch.zeros(8, 4)}, r"'head.weight' is \[8, 4\]")


def test_one_dtype_that_differs_is_refused_before_anything_is_read() -> None:
    # float64 bias: 16 bytes more than the model's float32 one, within the size bound, so the dtype
    # check (not the size check) is what refuses it
    with store() as srv:
        refused_unread(
            srv,
            {**model(1), "head.bias": torch.zeros(4, dtype=torch.float64)},
            r"'head\.bias' is torch\.float64",
        )


def test_a_reader_holding_a_generation_keeps_it_when_the_next_does_not_fit() -> None:
    first = model(1)
    with store() as srv:
        number = publish(srv, first)
        weights = reader(srv)
        try:
            assert same(weights.bring("latest"), first)
            staged = dict(weights.staging)
            ops, sent = relayed(srv)
            publish(srv, {**model(2), "head.bias": torch.zeros(5)})
            with pytest.raises(LayoutMismatch, match=r"'head\.bias'"):
                weights.bring("latest")
            assert weights.staging == staged  # the very same tensors, still the first generation
            assert all(torch.equal(weights.staging[k], first[k]) for k in first)
            assert relayed(srv) == (ops, sent)
            assert weights._subscriber is not None and weights._subscriber.generation == number
        finally:
            weights.close()


# -- 2. a generation larger than the model ---------------------------------------------------------
def test_float64_weights_for_a_float32_model_are_refused_before_they_are_read() -> None:
    doubled = {k: v.to(torch.float64) for k, v in model(1).items()}
    with store() as srv:
        refused_unread(srv, doubled, "generation 1")


def test_a_generation_over_the_models_size_is_refused_by_its_size_first() -> None:
    # 64 KiB of an extra tensor: the manifest's byte count refuses it before a name is looked at
    with store() as srv:
        refused_unread(
            srv, {**model(1), "extra": torch.zeros(16 << 10)}, r"holds \d+ bytes, more than the \d+"
        )


def test_a_reference_whose_bound_is_under_the_generation_refuses_it_unread() -> None:
    class Small(Reference):
        @property
        def most_bytes(self) -> int:
            return 100  # under the 704 bytes model(1)'s weights take

    small = Small(REFERENCE.expected, "a reference bounded under the model")
    with store() as srv:
        publish(srv, model(1))
        weights = reader(srv, small)
        try:
            with pytest.raises(LayoutMismatch, match="more than the 100"):
                weights.bring("latest")
            assert weights.staging == {} and weights._subscriber is None
        finally:
            weights.close()
        assert relayed(srv) == (set(), 0)


# -- 3. the version record ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "record",
    [
        torch.zeros(MAX_VERSION_BYTES // 4, dtype=torch.float32),  # the right byte count, not uint8
        torch.zeros(16, dtype=torch.uint8),  # too short
        torch.zeros(MAX_VERSION_BYTES, 1, dtype=torch.uint8),  # the right bytes, another shape
    ],
    ids=["float32", "short", "2d"],
)
def test_a_malformed_version_record_is_refused(record: torch.Tensor) -> None:
    with store() as srv:
        refused_unread(srv, {**model(1), VERSION_KEY: record}, "version record")


def test_a_version_record_over_its_size_is_refused() -> None:
    with store() as srv:
        refused_unread(srv, {**model(1), VERSION_KEY: torch.zeros(4096, dtype=torch.uint8)}, "generation 1")


# -- 4. the engine authenticates ---------------------------------------------------------------------
@pytest.mark.parametrize("token", [None, "not-the-token"], ids=["none", "wrong"])
def test_a_reader_without_the_stores_token_is_refused(
    token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TENSORWIRE_TOKEN", raising=False)
    with store() as srv:
        publish(srv, model(1))
        weights = WeightReader(ReaderOptions(srv.url, PREFIX, token=token, timeout=10.0), REFERENCE)
        try:
            with pytest.raises(AuthenticationError):
                weights.bring("latest")
            assert weights.staging == {}
        finally:
            weights.close()
        assert relayed(srv) == (set(), 0)


def test_a_reader_with_the_stores_token_brings_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORWIRE_TOKEN", raising=False)
    first = model(1)
    with store() as srv:
        number = publish(srv, first)
        weights = WeightReader(ReaderOptions(srv.url, PREFIX, token=TOKEN, timeout=10.0), REFERENCE)
        try:
            brought = weights.bring("latest")
        finally:
            weights.close()
    assert brought.number == number and same(brought, first)


# -- 5. only its own prefix --------------------------------------------------------------------------
def test_a_reader_reads_only_its_prefix() -> None:
    ours, theirs = model(1), model(666)
    with store() as srv:
        for _ in range(3):
            evil = publish(srv, theirs, prefix="evil")
        number = publish(srv, ours)
        publish(srv, theirs, prefix="evil")
        weights = reader(srv)
        try:
            brought = weights.bring("latest")
        finally:
            weights.close()
    assert (number, evil) == (1, 3)
    assert brought.number == number and brought.version == str(number)
    assert same(brought, ours)


# -- 6. corrupt chunks ---------------------------------------------------------------------------------
def corrupt(srv: tensorwire.ServerThread, number: int, key: str) -> None:
    """Flip one bit of ``key``'s bytes as the store holds them in generation ``number``."""
    _meta, data = srv.server.generations.find(PREFIX, number).tensors[f"{PREFIX}/{key}"]
    data[5] ^= 0x10


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
def test_a_chunk_changed_in_the_store_is_refused(verify: bool) -> None:
    first = model(1)
    with store() as srv:
        number = publish(srv, first)
        corrupt(srv, number, "embed.weight")
        weights = reader(srv, verify=verify)
        try:
            with pytest.raises(CorruptFrame):
                weights.bring("latest")
        finally:
            weights.close()


class _Matches:
    """A checksum equal to every other: what a per-chunk check that was not made compares as."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


def test_verify_refuses_what_the_per_chunk_check_let_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """``verify`` re-checks all of staging on its own: with the relay's per-chunk check made to
    pass every chunk, a chunk changed in the store still does not come back as weights."""
    from tensorwire.broadcast import relay_pull

    monkeypatch.setattr(relay_pull, "checksum", lambda kind, data: _Matches())
    with store() as srv:
        number = publish(srv, model(1))
        corrupt(srv, number, "embed.weight")
        weights = reader(srv, verify=True)
        try:
            with pytest.raises(DigestMismatch, match=r"'policy/embed\.weight'"):
                weights.bring("latest")
        finally:
            weights.close()


def test_verify_accepts_a_generation_published_without_a_version() -> None:
    first = model(1)
    with store() as srv:
        number = publish(srv, first)
        weights = reader(srv, verify=True)
        try:
            brought = weights.bring("latest")
        finally:
            weights.close()
    assert brought.number == number and brought.version == str(number) and same(brought, first)


# -- 7. a store that never answers ---------------------------------------------------------------------
def test_a_store_that_never_answers_costs_the_timeout_not_more() -> None:
    # a listener nobody accepts on: the kernel completes the connection, nothing ever answers
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        options = ReaderOptions(
            f"tcp://127.0.0.1:{port}", PREFIX, token=TOKEN, timeout=1.0, connect_timeout=1.0
        )
        weights = WeightReader(options, REFERENCE)
        started = time.monotonic()
        try:
            with pytest.raises(TensorwireError):
                weights.bring("latest")
        finally:
            weights.close()
        assert time.monotonic() - started < 5.0
    assert weights.staging == {}


# -- 8. a multi-part publish that loses a part -----------------------------------------------------------
def part_publisher(srv: tensorwire.ServerThread, rank: int) -> WeightPublisher:
    options = PublisherOptions(
        srv.url, PREFIX, token=TOKEN, rank=rank, world_size=2, run_id="r", timeout=10.0, part_timeout=1.0
    )
    return WeightPublisher(options)


def test_a_part_that_never_comes_leaves_the_previous_generation_newest() -> None:
    first = model(1)
    with store() as srv:
        number = publish(srv, first)
        rank0 = part_publisher(srv, 0)
        try:
            with pytest.raises(WaitTimeout, match="missing: parts"):  # rank 1 never publishes
                rank0.publish(model(2).items(), version="step-2")
        finally:
            rank0.close()
        weights = reader(srv)
        try:
            brought = weights.bring("latest")
        finally:
            weights.close()
    assert brought.number == number and brought.version == str(number) and same(brought, first)


def test_a_part_that_fails_aborts_the_whole_and_leaves_the_previous_generation_newest() -> None:
    first, second = model(1), model(2)
    with store() as srv:
        number = publish(srv, first)
        rank0, rank1 = part_publisher(srv, 0), part_publisher(srv, 1)
        failed: list[BaseException] = []

        def publish_rank0() -> None:
            try:
                rank0.publish(second.items(), version="step-2")
            except BaseException as exc:  # asserted below, on the test's thread
                failed.append(exc)

        thread = threading.Thread(target=publish_rank0)
        thread.start()
        try:
            # rank 1 sends a name rank 0's part holds too: its part fails, and with it the whole
            with pytest.raises(PublishAborted):
                rank1.publish([("embed.weight", second["embed.weight"]), ("head.bias", second["head.bias"])])
        finally:
            thread.join(10.0)
            rank0.close()
            rank1.close()
        assert not thread.is_alive() and len(failed) == 1 and isinstance(failed[0], PublishAborted)
        weights = reader(srv)
        try:
            brought = weights.bring("latest")
        finally:
            weights.close()
    assert brought.number == number and same(brought, first)


# -- 9. catch_up reads a version record only of its fixed size ---------------------------------------
class _Calls:
    """The engine side of catch_up's calls, recorded (what is tested is catch_up's read of the store)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        return lambda *args, **kwargs: self.calls.append(name)


def test_catch_up_reads_a_version_record_only_of_its_fixed_size() -> None:
    """A store whose version record is larger than a record (4 MiB here) is refused before the
    record is read, and the engine is not asked to update; a right-sized one gives the version."""
    import tensorwire.vllm

    with store() as srv:
        publish(srv, {**model(1), VERSION_KEY: torch.zeros(4 << 20, dtype=torch.uint8)})
        engine = _Calls()
        with pytest.raises(TensorwireError):
            tensorwire.vllm.catch_up(engine, srv.url, PREFIX, token=TOKEN, timeout=10.0)
        assert engine.calls == []
        record = torch.zeros(MAX_VERSION_BYTES, dtype=torch.uint8)
        record[:6] = torch.tensor(list(b"step-7"), dtype=torch.uint8)
        publish(srv, {**model(2), VERSION_KEY: record})
        assert tensorwire.vllm.catch_up(engine, srv.url, PREFIX, token=TOKEN, timeout=10.0) == "step-7"
        assert engine.calls == [
            "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"
        ]  # fmt: skip
