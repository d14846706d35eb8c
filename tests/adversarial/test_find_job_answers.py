"""``find_job`` (a reader that names no job) reads the servers' PS_STATS answers: a server's JSON,
so its shape and job ids are checked. A malformed answer is a ProtocolError naming the server,
not an AttributeError from deep inside, nor a hostile id taken for a job."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from tensorwire.errors import ProtocolError
from tensorwire.ps.worker import rendezvous
from tensorwire.ps.worker.shards import check_params, model_digest

URL = "tcp://127.0.0.1:9"


def answer(monkeypatch: pytest.MonkeyPatch, doc: dict[str, Any]) -> None:
    monkeypatch.setattr(rendezvous, "server_stats", lambda urls, **kw: [doc])


@pytest.mark.parametrize(
    "jobs",
    [["run-17"], {"run-17": "a string"}, {"run-17": 3}, {"../../etc": {"model": "D"}}],
    ids=["a-list", "a-string-summary", "a-number-summary", "a-path-for-an-id"],
)
def test_a_malformed_job_list_is_a_protocol_error_naming_the_server(
    monkeypatch: pytest.MonkeyPatch, jobs: object
) -> None:
    model = torch.nn.Linear(2, 2)
    digest = model_digest(check_params(model))
    if isinstance(jobs, dict):
        jobs = {k: ({"model": digest} if v == {"model": "D"} else v) for k, v in jobs.items()}
    answer(monkeypatch, {"jobs": jobs})
    with pytest.raises(ProtocolError, match=re.escape("127.0.0.1:9")):
        rendezvous.find_job(model, [URL], timeout=1)


def test_a_well_formed_answer_names_the_one_job_of_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(2, 2)
    digest = model_digest(check_params(model))
    answer(monkeypatch, {"jobs": {"run-17": {"model": digest}, "other": {"model": "x"}}})
    assert rendezvous.find_job(model, [URL], timeout=1) == "run-17"
