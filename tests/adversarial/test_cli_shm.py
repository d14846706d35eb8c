"""shm:// against other local users and other listeners: files planted under the server's next
segment names cost a retry, never a put; SHM_* requests are served only on the shm:// listener."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorwire import connect
from tensorwire import transport as transports
from tensorwire._aio import run
from tensorwire.errors import ProtocolError
from tensorwire.server import ServerThread
from tensorwire.store import TensorStore
from tensorwire.testing.process import ServerProcess, wait_for
from tensorwire.transport.frame_client import FramedTransport
from tensorwire.types import Address, MiB, TensorMeta
from tensorwire.wire import meta as wm
from tensorwire.wire import shm as ws
from tensorwire.wire.frame import Opcode


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A segment directory of this test's own (on tmpfs where there is one), for both sides."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="tw-adv-shm-", dir=base) as d:
        monkeypatch.setenv(ws.SHM_DIR_ENV, d)
        yield Path(d)


def _prefix(directory: Path) -> str:
    probes = [n for n in os.listdir(directory) if n.endswith("-probe")]
    assert len(probes) == 1, probes
    return probes[0][: -len("probe")]


def test_files_planted_under_the_next_segment_names_cost_no_put(shm_dir: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    with ServerProcess("shm://127.0.0.1:0", capacity="256MiB") as srv:
        wait_for(lambda: any(n.endswith("-probe") for n in os.listdir(shm_dir)), 10, "the probe file")
        prefix = _prefix(shm_dir)  # the names the server will use next: <prefix>1, <prefix>2, ...
        for n in range(1, 65):
            (shm_dir / f"{prefix}{n}").write_bytes(b"planted")
        os.symlink(victim, shm_dir / f"{prefix}65")  # a symlink is a taken name too, never followed
        with connect(srv.url) as c:
            for i in range(6):
                x = torch.full((1 << 16,), float(i))  # 256 KiB: a segment each
                c.put(f"t{i}", x)
                assert torch.equal(c.get(f"t{i}"), x)
        assert "shared-memory name taken" in srv.output()
    assert victim.read_bytes() == b"keep me"
    assert all((shm_dir / f"{prefix}{n}").read_bytes() == b"planted" for n in range(1, 65))


def test_a_taken_probe_name_gets_a_fresh_prefix(shm_dir: Path) -> None:
    from tensorwire.store.shm import SegmentPool

    pool = SegmentPool(shm_dir, limit=MiB)
    (shm_dir / f"{pool.prefix}probe").write_bytes(b"planted")
    first = pool.prefix
    probe = pool.create_probe(b"12345678")
    assert pool.prefix != first and probe.read_bytes() == b"12345678"
    pool.close()
    probe.unlink()


async def _shm_requests_over(url: str) -> list[str]:
    """Each SHM_* request sent on a plain tcp:// connection: the errors they got."""
    conn = await transports.open_transport(Address.parse(url), transports.TransportOptions(5.0, 5.0))
    assert isinstance(conn, FramedTransport)
    errors = []
    meta = TensorMeta("stolen", torch.float32, (1 << 16,), 1 << 18)
    requests = [
        (Opcode.SHM_ATTACH, b""),
        (Opcode.SHM_PUT, wm.encode_records([meta])),
        (Opcode.SHM_GET, bytes([0]) + wm.encode_names(["kept"])),
        (Opcode.SHM_RELEASE, ws.encode_release([1], [1])),
    ]
    try:
        for op, body in requests:
            try:
                await conn.call(op, body, what=op.name)
                errors.append(f"{op.name} was served")
            except ProtocolError as exc:
                errors.append(str(exc))
    finally:
        await conn.close()
    return errors


def test_shm_requests_are_refused_on_the_tcp_listener_of_the_same_server(shm_dir: Path) -> None:
    store = TensorStore(64 * MiB)
    with ServerThread(["shm://127.0.0.1:0", "tcp://127.0.0.1:0"], store=store) as srv:
        shm_url, tcp_url = (str(a) for a in srv.addresses)
        with connect(shm_url) as c:
            c.put("kept", torch.ones(1 << 16))
        used = store.used
        errors = run(_shm_requests_over(tcp_url))
        assert all("served only on the shm:// listener" in e for e in errors), errors
        assert store.used == used  # no segment reserved, nothing pinned
        with connect(shm_url) as c:  # the shm:// listener still serves them
            assert torch.equal(c.get("kept"), torch.ones(1 << 16))
