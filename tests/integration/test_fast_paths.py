"""Fast paths over real servers on loopback: striping, the client cache, one round trip for a
state_dict, CUDA staging (its pipeline on the CPU here; the device itself where there is one)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import threading
from collections.abc import Iterator

import pytest
import torch

import tensorwire
from tensorwire import errors
from tensorwire.client import AsyncClient, Client, ClientOptions, staging
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.transport.frame_client import FramedTransport


@pytest.fixture
def server() -> Iterator[ServerThread]:
    with ServerThread(["tcp://127.0.0.1:0"], store=TensorStore(1 << 30)) as srv:
        yield srv


def _requests_sent(client: Client) -> int:
    """Request ids the client's connection has used so far (HELLO included): its round trips."""
    transport = client._async._transport
    assert isinstance(transport, FramedTransport)
    peek, transport._mux._ids = itertools.tee(transport._mux._ids)
    return next(peek) - 1


# -- striping --------------------------------------------------------------------------------------
def test_striped_put_and_get_are_bit_exact(server: ServerThread) -> None:
    x = torch.randn(3 * (1 << 20) + 123)  # 12 MiB + change: three ranges, the last one short
    with tensorwire.connect(server.url, stripes=3, stripe_bytes=1 << 20) as c:
        version = c.put("big", x)
        assert len(c._async._transfers.lanes.lanes) == 3  # type: ignore[union-attr]
        out = torch.empty_like(x)
        assert c.get("big", out=out) is out and torch.equal(out, x)
        assert torch.equal(c.get("big"), x)  # size known from the put: striped without out too
        assert c.stat("big").version == version
    with tensorwire.connect(server.url, stripes=1) as plain:
        assert torch.equal(plain.get("big"), x)  # what a one-connection client reads back


def test_striped_get_reads_again_when_the_tensor_changes(server: ServerThread) -> None:
    with tensorwire.connect(server.url, stripes=2, stripe_bytes=1 << 20) as c:
        c.put("moving", torch.zeros(1 << 20))
        meta = c.stat("moving")
        c.put("moving", torch.ones(1 << 20))
        from tensorwire.client import stripe

        out = torch.empty(1 << 20)
        ops = stripe.get_ops(meta, memoryview(out.numpy()).cast("B"), 2)  # pinned to the old version
        with pytest.raises(errors.VersionChanged):
            c._call(c._async._transfers._lanes().run(ops, 0, lambda _: 0.0))
        assert torch.equal(c.get("moving", out=out), torch.ones(1 << 20))


# -- cache -------------------------------------------------------------------------------------------
def test_cache_hit_costs_one_stat_and_sees_other_writers(server: ServerThread) -> None:
    with tensorwire.connect(server.url, cache_bytes=1 << 20) as c, tensorwire.connect(server.url) as other:
        other.put("w", torch.arange(10.0))
        first = c.get("w")
        before = _requests_sent(c)
        again = c.get("w")
        assert _requests_sent(c) == before + 1  # one STAT, no GET
        assert torch.equal(again, first) and again.data_ptr() != first.data_ptr()
        again += 1  # the caller's copy: the cache is not changed through it
        assert torch.equal(c.get("w"), torch.arange(10.0))
        other.put("w", torch.full((10,), 7.0))  # another client overwrites the key
        assert torch.equal(c.get("w"), torch.full((10,), 7.0))
        out = torch.empty(10)
        assert c.get("w", out=out) is out and torch.equal(out, torch.full((10,), 7.0))
        assert c._async.cache.hits >= 3


def test_cache_lease_skips_the_check_and_own_writes_invalidate(server: ServerThread) -> None:
    with tensorwire.connect(server.url, cache_bytes=1 << 20, cache_lease=3600.0) as c:
        c.put("p", torch.ones(4))
        c.get("p")
        before = _requests_sent(c)
        assert torch.equal(c.get("p"), torch.ones(4))
        assert _requests_sent(c) == before  # within the lease: nothing sent at all
        c.put("p", torch.zeros(4))  # this client's own put drops its copy
        assert torch.equal(c.get("p"), torch.zeros(4))
        c.delete("p")
        with pytest.raises(errors.KeyNotFound):
            c.get("p")


def test_cache_is_bounded_least_recently_used_first(server: ServerThread) -> None:
    with tensorwire.connect(server.url, cache_bytes=1000) as c:
        for name in "abc":
            c.put(name, torch.zeros(100))  # 400 bytes each: two fit
            c.get(name)
        cache = c._async.cache
        assert cache.used <= 1000 and cache.lookup("a") is None and cache.lookup("c") is not None
        c.put("huge", torch.zeros(1000))
        c.get("huge")
        assert cache.lookup("huge") is None  # larger than the whole cache: never kept


# -- small tensors -----------------------------------------------------------------------------------
def test_a_state_dict_round_trip_is_one_request_each_way(server: ServerThread) -> None:
    layers = [torch.nn.Linear(8, 8) for _ in range(150)]
    state = torch.nn.Sequential(*layers).state_dict()  # 300 small parameters
    assert len(state) == 300
    with tensorwire.connect(server.url) as c:
        before = _requests_sent(c)
        c.put_many(state)
        assert _requests_sent(c) == before + 1
        got = c.get_many(list(state))
        assert _requests_sent(c) == before + 2
        assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_large_batch_leaves_the_collector_alone(server: ServerThread) -> None:
    """A put_many and a get_many (into ``out``) of 3,000 small tensors: no cyclic collection runs
    in the client while they do (each tensor's records and views would be walked and promoted, a
    third of the client's CPU per tensor at 10,000), and the collector is on again after. (The
    server here shares the process, and its store keeps what the batch put: its collections, owed
    once the client's call is over, are not the batch's.)"""
    tensors = {f"gc/{i}": torch.full((4,), float(i)) for i in range(3000)}
    out = {name: torch.empty(4) for name in tensors}
    runs: list[tuple[str, int]] = []

    def counted(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and threading.current_thread().name != "tensorwire-server":
            runs.append((threading.current_thread().name, info["generation"]))

    with tensorwire.connect(server.url) as c:
        c.put_many(tensors)  # warm: the connection, the server's first batch
        for call in (lambda: c.put_many(tensors), lambda: c.get_many(list(tensors), out=out)):
            gc.collect()  # what is owed from before is not the batch's to pay
            gc.callbacks.append(counted)
            try:
                call()
            finally:
                gc.callbacks.remove(counted)
    assert runs == [], f"collections (thread, generation) {runs} ran during the batches"
    assert gc.isenabled()
    assert all(torch.equal(out[k], v) for k, v in tensors.items())


# -- pinned staging --------------------------------------------------------------------------------
def test_pinned_pool_reuses_a_bounded_set_of_buffers() -> None:
    pool = staging.PinnedPool(piece_bytes=1024, count=2, pin=False)
    a, b = pool.take(), pool.take()
    assert pool.free == 0 and pool.made == 2
    with pytest.raises(RuntimeError):
        pool.take()
    pool.give(a)
    assert pool.take() is a  # reused, not made again
    pool.give(a)
    pool.give(b)
    assert pool.free == 2 and pool.made == 2
    with pytest.raises(ValueError):
        staging.PinnedPool(count=1)


def test_staged_pipeline_moves_every_piece_in_order(server: ServerThread) -> None:
    """The CUDA path's pipeline with host copies: many pieces through three reused buffers."""

    async def go() -> None:
        client = AsyncClient(server.url, ClientOptions())
        pool = staging.PinnedPool(piece_bytes=64 << 10, count=3, pin=False)
        x = torch.randn(1_000_003)  # 61 pieces, the last one short
        try:
            upload, meta = await staging.put_staged(client._run, pool, "staged", x, staging.HostCopier())
            with pytest.raises(errors.KeyNotFound):
                await client.stat("staged")  # nothing visible before the commit
            await client._transfers._commit(upload, meta)
            out = torch.empty_like(x)
            stored = await client.stat("staged")
            await staging.get_staged(client._run, pool, stored, out, staging.HostCopier())
            assert torch.equal(out, x)
            assert pool.made == 3 and pool.free == 3  # every buffer came back
        finally:
            await client.close()

    asyncio.run(go())


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


@pytest.mark.cuda
@cuda
def test_cuda_put_and_get_into_a_device_tensor(server: ServerThread) -> None:
    x = torch.randn(5_000_001, device="cuda")
    with tensorwire.connect(server.url) as c:
        c.put("gpu", x)
        assert torch.equal(c.get("gpu"), x.cpu())
        out = torch.empty_like(x)
        assert c.get("gpu", out=out) is out
        assert torch.equal(out, x)
        assert c._async._transfers._pool is not None and c._async._transfers._pool.pin


# -- compression negotiation -------------------------------------------------------------------------
def test_a_server_from_before_compression_gets_raw_chunks() -> None:
    """A peer that refuses HELLO's compression field (as a server without it does): the client says
    HELLO again without it and the connection sends raw chunks."""
    from tensorwire.testing.conformance import Harness, read_reply
    from tensorwire.transport.base import ByteStream
    from tensorwire.transport.frame_io import FrameReader, send_frame
    from tensorwire.types import Limits
    from tensorwire.wire import meta as wm
    from tensorwire.wire.frame import Flags, Header, Opcode

    hellos: list[bool] = []

    async def old_server(stream: ByteStream) -> None:
        reader = FrameReader(stream)
        while await reader.at_frame_start():
            header, meta = await read_reply(reader)
            asked = meta.remaining > 2  # versions only, or a token: no compression field here
            hellos.append(asked)
            if asked:
                block = wm.encode_error(errors.ErrorCode.PROTOCOL_ERROR, "2 unexpected bytes")
                flags = Flags.RESPONSE | Flags.ERROR
            else:
                block = wm.encode_hello_response(wm.ServerInfo(1, Limits(), 1 << 30, 0))
                flags = Flags.RESPONSE
            answer = Header(1, Opcode.HELLO, flags, 0, header.request_id, len(block), 0, 0)
            await send_frame(stream, answer, block)

    async def go() -> None:
        async with Harness("tcp").peer(old_server) as url:
            client = await tensorwire.aconnect(url, compression="lz4", retries=0)
            try:
                transport = client._transport
                assert isinstance(transport, FramedTransport) and transport.encoder is None
            finally:
                await client.close()

    asyncio.run(go())
    # compression + wants (store id), then compression alone, both refused; then a plain HELLO
    assert hellos == [True, True, False]
