"""GPU-direct over rdma://: with a CUDA build of the engine, CUDA tensors are registered and moved
from and into device memory by the engine itself (``DeviceDirect``), every chunk still checked.
``make gpu-check`` runs it (``-m cuda``) where a GPU is lent; it skips, saying why, elsewhere."""

from __future__ import annotations

import pytest
import torch

import tensorwire
from tensorwire import ServerThread
from tensorwire.testing import rdma as kit
from tensorwire.transport import rdma_engine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(kit.unavailable() is not None, reason=f"rdma:// cannot run: {kit.unavailable()}"),
    pytest.mark.skipif(
        not rdma_engine.cuda_build(),
        reason=f"needs the engine's CUDA build ({rdma_engine.CUDA_DISTRIBUTION}); CPU build installed",
    ),
]


@pytest.fixture(autouse=True)
def tcp_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    if not rdma_engine.unavailable():  # an RDMA NIC here: use it (GPU-direct proper)
        return
    for key, value in kit.TCP_MODE.items():
        monkeypatch.setenv(key, value)


def test_cuda_tensors_move_gpu_direct_and_round_trip() -> None:
    device = torch.device("cuda", 0)
    tensor = torch.randn(1 << 20, device=device)  # 4 MiB: through the engine, not inline
    small = torch.arange(10, device=device)
    with ServerThread(["rdma://127.0.0.1:0"]) as srv, tensorwire.connect(srv.url) as client:
        client.put("w", tensor)
        client.put("s", small)
        out = torch.empty_like(tensor)
        client.get("w", out=out)
        assert torch.equal(out, tensor)
        out_small = torch.empty_like(small)
        client.get("s", out=out_small)
        assert torch.equal(out_small, small)
        assert torch.equal(client.get("w"), tensor.cpu())  # read back to host: the same bytes
