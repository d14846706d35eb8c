"""A GET answer's record is kept on its entry only when short: an entry is charged
``ENTRY_OVERHEAD`` besides its bytes, and a peer choosing 32 dims or a 1 KiB name must not make
every stored tensor hold up to ~1.3 KiB more than it is charged for once it has been read."""

from __future__ import annotations

import torch

import tensorwire
from tensorwire.server import ServerThread
from tensorwire.server.store_requests import RECORD_KEPT_BYTES
from tensorwire.store import TensorStore
from tensorwire.store.memory import ENTRY_OVERHEAD

LONG_NAME = "n/" + "x" * 1000  # near the longest name allowed (1 KiB)
MANY_DIMS = (1,) * 32  # as many as the server allows (Limits.max_ndim)


def test_long_records_are_answered_but_not_kept() -> None:
    store = TensorStore(64 << 20)
    with ServerThread(store=store) as server, tensorwire.connect(server.url) as client:
        client.put(LONG_NAME, torch.ones(3))
        client.put("n/dims", torch.ones(MANY_DIMS))
        client.put("n/short", torch.ones(3))
        for _ in range(2):  # the second read answers from whatever the first one kept
            assert torch.equal(client.get(LONG_NAME), torch.ones(3))
            assert torch.equal(client.get("n/dims"), torch.ones(MANY_DIMS))
            assert torch.equal(client.get("n/short"), torch.ones(3))
            got = client.get_many([LONG_NAME, "n/short", "n/dims"])
            assert got["n/dims"].shape == MANY_DIMS
        (long_entry, dims, short) = store.acquire([LONG_NAME, "n/dims", "n/short"])
        store.release([long_entry, dims, short])
    assert long_entry.record == b"" and dims.record == b""  # ~1 KiB and ~0.3 KiB: never kept
    assert 0 < len(short.record) <= RECORD_KEPT_BYTES < ENTRY_OVERHEAD // 2
