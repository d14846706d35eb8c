"""Parameter-server workers and exchange clients reach tls:// servers signed by a private CA,
with a token: the TLS settings a job needs beyond a trusted network."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorwire.errors import ConnectError
from tensorwire.ps import SGD, ParamServer, Worker, pull_parameters
from tensorwire.ps.exchange.client import ExchangeClient
from tensorwire.security import TlsFiles, write_dev_certs
from tensorwire.server import ServerThread
from tensorwire.server.options import ServerOptions

TOKEN = "ps-over-tls"


def test_a_worker_and_an_exchange_client_over_tls_with_a_private_ca(tmp_path: Path) -> None:
    paths = write_dev_certs(tmp_path)
    served = ServerOptions(tls=TlsFiles(paths["server"], paths["server_key"]), token=TOKEN)
    ca = TlsFiles(ca=paths["ca"])
    ps = ParamServer(keep_jobs=True)  # the job is read after its worker left
    with ServerThread(["tls://127.0.0.1:0"], served, extensions=[ps]) as server:
        url = server.url.replace("127.0.0.1", "localhost")
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        before = model.weight.detach().clone()
        with Worker(model, url, "sync", SGD(lr=0.5), rank=0, world_size=1, token=TOKEN, tls=ca) as worker:
            model(torch.randn(4, 8)).sum().backward()
            worker.step()
        assert not torch.equal(model.weight, before)
        reader = torch.nn.Linear(8, 2)
        pull_parameters(reader, url, token=TOKEN, tls=ca)
        assert torch.equal(reader.weight, model.weight)
        with ExchangeClient(url, rank=0, world_size=1, token=TOKEN, tls=ca) as exchange:
            grads = {"g": torch.ones(4)}
            assert exchange.allreduce(grads) == 1
        # Without the CA, the server's certificate does not verify.
        untrusting = Worker(torch.nn.Linear(8, 2), url, rank=0, world_size=1, token=TOKEN)
        with pytest.raises(ConnectError), untrusting:
            pass
