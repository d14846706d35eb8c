"""A real server process on loopback: the client API end to end, and tensors over 2 GiB."""

from __future__ import annotations

import gc
import time

import pytest
import torch

import tensorwire
import tensorwire._aio
from tensorwire.testing.conformance import random_tensor, same_bytes
from tensorwire.testing.process import ServerProcess


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess(capacity="6GiB") as srv:
        yield srv  # type: ignore[misc]


def test_sync_client_round_trips_a_state_dict(server: ServerProcess) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.BatchNorm1d(30), torch.nn.Linear(30, 5))
    state = model.state_dict()
    with tensorwire.connect(server.url) as c:
        assert c.transport == "tcp"
        version = c.put_many({f"sd/{k}": v for k, v in state.items()})
        back = c.get_many([f"sd/{k}" for k in state])
        assert all(same_bytes(back[f"sd/{k}"], v) for k, v in state.items())
        assert {m.version for m in c.list("sd/")} == {version}
        # get(out=) fills the live parameters in place
        fresh = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.BatchNorm1d(30), torch.nn.Linear(30, 5))
        c.get_many([f"sd/{k}" for k in state], out={f"sd/{k}": v for k, v in fresh.state_dict().items()})
        assert all(
            torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values(), strict=True)
        )
        assert c.ping() > 0


def test_async_client(server: ServerProcess) -> None:
    async def main() -> None:
        async with await tensorwire.aconnect(server.url) as c:
            x = random_tensor(torch.bfloat16, (3, 5))
            await c.put("async/x", x)
            assert same_bytes(await c.get("async/x"), x)
            await c.delete("async/x")

    tensorwire._aio.run(main())


@pytest.mark.slow
def test_a_tensor_over_two_gib(server: ServerProcess) -> None:
    n = (2 << 30) + 4099  # past every 32-bit length
    x = torch.empty(n, dtype=torch.uint8)
    x[:: 1 << 20] = 7
    x[-5:] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    with tensorwire.connect(server.url, timeout=120) as c:
        c.put("huge", x)
        assert c.stat("huge").nbytes == n
        out = torch.zeros(n, dtype=torch.uint8)
        c.get("huge", out=out)
        assert torch.equal(out, x)
        c.delete("huge")


def test_unknown_scheme_and_unreachable_server() -> None:
    with pytest.raises(ValueError, match="scheme"):
        tensorwire.connect("ftp://x:1")
    with pytest.raises(tensorwire.errors.ConnectError):
        tensorwire.connect("tcp://127.0.0.1:1", retries=1, backoff=0.01)


def test_a_failing_progress_callback_does_not_poison_the_connection(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    def explode(_: int) -> None:
        raise ValueError("the caller's own bug")

    with tensorwire.connect(server.url, timeout=5) as c:
        with pytest.raises(ValueError, match="own bug"):
            c.put("cb/x", torch.zeros(1 << 22), progress=explode)
        gc.collect()  # the failed request's future: its outcome was heard (the ValueError), not left
        assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
        start = time.monotonic()
        c.put("cb/y", torch.ones(3))  # a new connection, at once, not a timeout
        assert time.monotonic() - start < 3
        assert torch.equal(c.get("cb/y"), torch.ones(3))
