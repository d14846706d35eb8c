"""shm:// beyond the conformance suite: segment reuse, views and their leases, torn reads under
concurrent overwrites, abandoned puts, typed refusals, persistence and the CLI."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tensorwire import cli, connect
from tensorwire._aio import run
from tensorwire.client import AsyncClient
from tensorwire.errors import InvalidName, ProtocolError, SharedMemoryUnavailable
from tensorwire.server import ServerThread
from tensorwire.server import shm as server_shm
from tensorwire.server.request import extension_of
from tensorwire.server.shm import ShmSession
from tensorwire.store import TensorStore
from tensorwire.store.shm import SegmentPool
from tensorwire.testing.conformance import STREAM_CASES, Case, corrupt_get_response_is_retried, run_case
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.transport.shm import ShmTransport, _Stale
from tensorwire.types import MiB, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import shm as ws
from tensorwire.wire.frame import Opcode
from tensorwire.wire.tensors import byte_view

SHM = Path("/dev/shm")


@pytest.fixture
def served() -> Iterator[ServerThread]:
    with ServerThread(["shm://127.0.0.1:0"], store=TensorStore(256 * MiB)) as srv:
        yield srv


def pool(srv: ServerThread) -> SegmentPool:
    service = extension_of(srv.server.extensions, server_shm.ShmService)
    assert service is not None
    return service.pool


def files(prefix: str) -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(prefix) and not n.endswith("probe")}


def leases(srv: ServerThread) -> int:
    return sum(s.states[ShmSession].leased for s in list(srv.server._sessions) if ShmSession in s.states)


def test_get_lands_in_out_and_warm_puts_reuse_segments(served: ServerThread) -> None:
    with connect(served.url) as c:
        assert c.transport == "shm"
        out = torch.empty(1 << 18)
        for i in range(12):
            x = torch.full((1 << 18,), float(i))
            c.put("w", x)
            assert c.get("w", out=out) is out and torch.equal(out, x)
        # an overwrite needs a second segment while the first is read; after that they alternate
        assert len(files(pool(served).prefix)) <= 3


def _mapping_perms(address: int) -> str:
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return perms
    raise AssertionError(f"{address:#x} is in no mapping")


def test_a_view_is_a_read_only_snapshot_held_by_its_lease(served: ServerThread) -> None:
    with connect(served.url) as c:
        x = torch.randn(1 << 18)
        c.put("v", x)
        view = c.get("v", view=True)
        assert torch.equal(view, x)
        assert _mapping_perms(view.data_ptr()) == "r--s"  # the pages themselves: shared, read-only
        c.put("v", torch.zeros_like(x))  # the key changes while the view is held
        assert torch.equal(view, x), "an overwrite wrote into a leased segment"
        assert torch.equal(c.get("v"), torch.zeros_like(x))
        assert leases(served) == 1
        part = view[10:20]
        del view
        gc.collect()
        assert leases(served) == 1 and torch.equal(part, x[10:20])  # a slice keeps the lease
        del part
        gc.collect()
        wait_for(lambda: leases(served) == 0, 10, "the lease to be released")


def test_a_view_that_outlives_its_connection_is_never_reused(served: ServerThread) -> None:
    x = torch.randn(1 << 18)
    c1 = connect(served.url)
    c1.put("k", x)
    view = c1.get("k", view=True)
    c1.close()  # the lease ends with the connection, the view lives on
    wait_for(lambda: leases(served) == 0, 10, "the connection's leases to be dropped")
    with connect(served.url) as c2:
        for i in range(6):  # puts of the same size would reuse a free segment of that class
            c2.put("k", torch.full((1 << 18,), float(i)))
    assert torch.equal(view, x)


def test_a_copy_from_a_reused_segment_is_caught(served: ServerThread) -> None:
    """Between SHM_GET's answer and the copy, the key is overwritten twice: its old segment goes
    back to the pool and takes the second overwrite. The copy must notice (the generation moved)
    rather than return the newer bytes, or a mix, as the version it was told about."""

    async def race() -> None:
        reader, writer = AsyncClient(served.url), AsyncClient(served.url)
        try:
            await writer.put("r", torch.zeros(1 << 18))
            t = await reader._open()
            assert isinstance(t, ShmTransport)
            _, _, (ref,), _ = await t._locate(["r"], lease=False)
            await writer.put("r", torch.ones(1 << 18))
            await writer.put("r", torch.full((1 << 18,), 2.0))  # lands in the segment ref points to
            out = torch.empty(1 << 18)
            with pytest.raises(_Stale):
                t._copy_out(ref, byte_view(out))
            assert torch.equal(await reader.get("r", out=out), torch.full((1 << 18,), 2.0))
        finally:
            await reader.close()
            await writer.close()

    run(race())


def test_an_abandoned_put_is_never_visible(served: ServerThread) -> None:
    async def abandon() -> None:
        client = AsyncClient(served.url)
        t = await client._open()
        assert isinstance(t, ShmTransport)
        meta = TensorMeta("half", torch.float32, (1 << 20,), 4 << 20)
        reader = await t.call(Opcode.SHM_PUT, wm.encode_records([meta]), what="a put left open")
        reader.u64()
        (ref,) = ws.decode_refs(reader, 1)
        segment = t.maps.get(ref.segment, writable=True)
        segment[ws.HEADER_BYTES : ws.HEADER_BYTES + 100] = bytes(range(100))
        await client.close()  # no SHM_COMMIT

    run(abandon())
    store = served.server.store
    wait_for(lambda: store.used == 0, 10, "the abandoned reservation to be freed")
    with connect(served.url) as c:
        assert c.list() == []


def test_shm_needs_shared_pages_or_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ws.SHM_DIR_ENV, str(tmp_path))  # the server's segments: out of the client's sight
    with ServerThread(["shm://127.0.0.1:0"]) as srv:
        monkeypatch.delenv(ws.SHM_DIR_ENV)
        with pytest.raises(SharedMemoryUnavailable, match="cannot see"):
            connect(srv.url, retries=0)
    with ServerThread(["tcp://127.0.0.1:0"]) as srv:
        with pytest.raises(SharedMemoryUnavailable, match="does not serve shared memory"):
            connect(srv.url.replace("tcp://", "shm://"), retries=0)
        with connect(srv.url) as c:
            c.put("t", torch.ones(1 << 16))
            with pytest.raises(SharedMemoryUnavailable, match="needs an shm:// client"):
                c.get("t", view=True)
    with pytest.raises(ValueError, match="only this host"):
        ServerThread(["shm://0.0.0.0:0"])


def test_a_data_dir_reloads_into_segments(tmp_path: Path) -> None:
    x = torch.randn(1 << 18)
    store = TensorStore(256 * MiB, tmp_path)
    with ServerThread(["shm://127.0.0.1:0"], store=store) as srv, connect(srv.url) as c:
        c.put("p", x)
    with ServerThread(["shm://127.0.0.1:0"], store=TensorStore(256 * MiB, tmp_path)) as srv:
        (entry,) = srv.server.store.acquire(["p"])
        srv.server.store.release([entry])
        assert pool(srv).segment_of(entry.data) is not None
        with connect(srv.url) as c:
            assert torch.equal(c.get("p", view=True), x)


def test_cli_serves_shm(tmp_path: Path) -> None:
    source = tmp_path / "x.npy"
    np.save(source, np.arange(1 << 16, dtype=np.float32))
    with ServerProcess("shm://127.0.0.1:0", capacity="64MiB") as srv:
        assert srv.url.startswith("shm://127.0.0.1:")
        runner = CliRunner()
        result = runner.invoke(cli.main, ["put", "x", str(source), "--server", srv.url])
        assert result.exit_code == 0, result.output
        result = runner.invoke(cli.main, ["get", "x", "-o", str(tmp_path / "y.npy"), "--server", srv.url])
        assert result.exit_code == 0, result.output
        assert np.array_equal(np.load(tmp_path / "y.npy"), np.load(source))
        assert files(f"tensorwire-{srv.pid}-")  # the tensor lives in a segment of that server


def test_hostile_shm_requests_are_refused_and_the_session_goes_on(served: ServerThread) -> None:
    async def hostile() -> None:
        url = served.url.replace("shm://", "tcp://")  # the same listener, without SHM_ATTACH
        plain = AsyncClient(url)
        try:
            t = await plain._open()
            assert isinstance(t, FramedTransport)
            with pytest.raises(ProtocolError, match="SHM_ATTACH must come"):
                await t.call(Opcode.SHM_GET, b"\0" + wm.encode_names(["x"]), what="an early get")
            await t.ping()
        finally:
            await plain.close()
        client = AsyncClient(served.url)
        try:
            t = await client._open()
            big = TensorMeta("b", torch.float32, (1 << 16,), 1 << 18)
            with pytest.raises(ProtocolError, match="does not hold open"):
                await t.call(Opcode.SHM_COMMIT, wm.encode_u64(12345) + wm.encode_records([]), what="commit")
            with pytest.raises(InvalidName):
                bad = TensorMeta("../b", torch.float32, (1 << 16,), 1 << 18)
                await t.call(Opcode.SHM_PUT, wm.encode_records([bad]), what="a bad name")
            reader = await t.call(Opcode.SHM_PUT, wm.encode_records([big]), what="a put")
            put_id = reader.u64()
            lying = wm.encode_u64(put_id) + wm.encode_records([big])  # not an inline tensor of that put
            with pytest.raises(ProtocolError, match="inline records"):
                await t.call(Opcode.SHM_COMMIT, lying, [memoryview(bytes(1 << 18))], what="a lying commit")
            await t.call(Opcode.SHM_RELEASE, ws.encode_release([777], [put_id]), what="unknown ids")
            await t.ping()
        finally:
            await client.close()

    run(hostile())
    wait_for(lambda: served.server.store.used == 0, 10, "every refused put to be freed")
    with connect(served.url) as c:
        assert c.list() == []


# The shm:// control listener is the frame protocol's: every hostile-frame case that talks to a
# real server runs on it too (the one left out stands in for a server with a hand-written peer).
SERVER_STREAM_CASES = [c for c in STREAM_CASES if c is not corrupt_get_response_is_retried]


@pytest.mark.parametrize("case", SERVER_STREAM_CASES, ids=lambda c: c.__name__)
def test_frame_protocol_on_the_control_connection(case: Case) -> None:
    run_case(case, "shm")
