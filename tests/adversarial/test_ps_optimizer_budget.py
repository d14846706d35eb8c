"""A parameter server counts its optimizer's state against its capacity when the job is made:
Adam keeps two more copies of the parameters (momentum SGD one), which torch allocates at the
first step, after every check had passed; a job whose state does not fit must be refused at
PS_INIT, not run the server out of memory at its first step."""

from __future__ import annotations

import json

import pytest
import torch
from psid_kit import init

from tensorwire.errors import CapacityExceeded
from tensorwire.ps import ParamServer
from tensorwire.ps.worker.rpc import server_stats
from tensorwire.server import ServerThread

N = 1 << 16
KEY = f"w#0:{N}"


def job(kind: str, **settings: object) -> str:
    return json.dumps({"mode": "async", "optimizer": {"kind": kind, **settings}})


def test_adam_state_that_does_not_fit_is_refused_at_init() -> None:
    with ServerThread(extensions=[ParamServer(capacity=2 * 4 * N)]) as server:
        with pytest.raises(CapacityExceeded, match="optimizer state"):
            init(server.url, 0, 1, job("adam"), {KEY: torch.zeros(N)})
        init(server.url, 0, 1, job("sgd"), {KEY: torch.zeros(N)})  # plain SGD keeps no state: it fits


def test_the_optimizer_state_is_counted_and_shown() -> None:
    ps = ParamServer(capacity=8 * 4 * N)
    with ServerThread(extensions=[ps]) as server:
        init(server.url, 0, 1, job("sgd", momentum=0.9), {KEY: torch.zeros(N)})
        held = server_stats([server.url])[0]["held_bytes"]
        assert held["params"] == held["optimizer"] == 4 * N
