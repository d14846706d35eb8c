"""The public API holds: every name in the public ``__all__`` lists resolves (and none of the names
below went missing), and the README's Python examples run as written against a real server."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorwire
from tensorwire import ps
from tensorwire.broadcast import RelayCoordinator

README = Path(__file__).resolve().parents[2] / "README.md"

# The public names as of issue 14: a module may add names, never lose one.
PUBLIC: dict[str, set[str]] = {
    "tensorwire": {
        "Address", "AsyncClient", "Client", "ClientOptions", "Limits", "Security", "Server",
        "ServerThread", "TensorMeta", "TensorStore", "TlsFiles", "__version__", "aconnect", "connect",
        "errors",
    },
    "tensorwire.ps": {
        "SGD", "Adam", "AdamW", "CheckpointPolicy", "ExchangeClient", "JobConfig", "Mode", "OptimizerSpec",
        "ParamServer",
        "ParamSpec", "Placement", "PushResult", "Shard", "Worker", "plan", "pull_parameters",
    },
    "tensorwire.dataset": {
        "Digest", "DigestService", "FetchReport", "NodeReport", "Plan", "ScatterReport", "ShardDataset",
        "fetch", "make_plan", "scatter",
    },
    "tensorwire.compression": {
        "Cast", "Codec", "ErrorFeedback", "Int8", "Sign", "TopK", "codec_for", "decode_all", "from_wire",
        "payload_total", "resolve", "top_indices",
    },
    # The public test kit: what the tests (and other projects' transports) import from it.
    "tensorwire.testing.conformance": {
        "CASES", "RPC_CASES", "SCHEMES", "STREAM_CASES", "STREAM_SCHEMES", "Case", "Harness",
        "random_tensor", "run_case", "same_bytes", "put_frame", "raw", "read_reply",
        "corrupt_get_response_is_retried",
    },
    "tensorwire.testing.process": {"ServerProcess", "run_threads", "wait_for"},
}  # fmt: skip


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_every_public_name_resolves(module_name: str) -> None:
    module = importlib.import_module(module_name)
    exported = list(module.__all__)
    assert len(exported) == len(set(exported)), f"{module_name}.__all__ names a name twice"
    missing = [name for name in exported if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names what it does not have: {missing}"
    lost = PUBLIC[module_name] - set(exported)
    assert not lost, f"{module_name} no longer exports {sorted(lost)}"
    namespace: dict[str, Any] = {}
    exec(f"from {module_name} import *", namespace)  # the star import a user may write works too
    assert set(exported) <= set(namespace)


# -- the README's examples -------------------------------------------------------------------------
def python_blocks(text: str) -> Iterator[tuple[str, int, str]]:
    """(the section's heading, the line the code starts on, the code) of each ```python block."""
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("## "):
            heading = lines[i][3:].strip()
        if lines[i].strip() == "```python":
            end = lines.index("```", i + 1)
            yield heading, i + 2, "\n".join(lines[i + 1 : end]) + "\n"
            i = end
        i += 1


def _linear_model() -> dict[str, object]:
    return {"model": torch.nn.Linear(1024, 1024)}  # client.get(..., out=model.weight.data) of 1024 x 1024


def _shm_tensors() -> dict[str, object]:
    w = torch.randn(256, 256)  # 256 KiB: over the 64 KiB from which a tensor lives in a segment
    return {"w": w, "param": torch.nn.Parameter(torch.zeros_like(w))}


def _small_dataset() -> dict[str, object]:
    # One batch of 32 per epoch: the example's 10 epochs are 10 steps.
    features, labels = torch.randn(32, 64), torch.randint(0, 10, (32,))
    return {"my_dataset": torch.utils.data.TensorDataset(features, labels)}


def _model_with_grads() -> dict[str, object]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    model(torch.randn(4, 64)).sum().backward()
    return {"model": model}


# What each section's examples assume is there, besides ``torch``, ``tensorwire``, ``ps`` and ``url``
# (the server's tcp:// URL). A new section with a Python example needs an entry.
GIVEN: dict[str, Callable[[], dict[str, object]]] = {
    "The Python API": _linear_model,
    "Shared memory (`shm://`)": _shm_tensors,
    "The parameter server": _small_dataset,
    "Compression": _model_with_grads,
    "Generations": dict,  # the example builds its own models
    "Publish once, read by many": dict,
    "Sharded state (DTensor, FSDP)": dict,  # a world of one when torch.distributed is not initialised
}
BROKEN: dict[str, str] = {}  # examples that do not run as written, and why: strict, so a fix shows up
EXAMPLE_URL = re.compile(r"\b([a-z]+)://127\.0\.0\.1:\d+")
EXAMPLE_TIMEOUT = 60  # seconds for one example (they take well under one)


def _examples() -> list[Any]:
    params = []
    for heading, line, code in python_blocks(README.read_text()):
        marks = []
        if heading in BROKEN:
            marks.append(pytest.mark.xfail(strict=True, raises=AttributeError, reason=BROKEN[heading]))
        params.append(pytest.param(heading, line, code, id=f"README.md:{line}", marks=marks))
    return params


def test_the_readme_has_the_examples_this_test_knows() -> None:
    headings = {heading for heading, _, _ in python_blocks(README.read_text())}
    assert headings == set(GIVEN), f"give the names the examples of {headings ^ set(GIVEN)} assume in GIVEN"


@pytest.mark.timeout(EXAMPLE_TIMEOUT)
@pytest.mark.parametrize(("heading", "line", "code"), _examples())
def test_readme_example_runs(heading: str, line: int, code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    urls = ["tcp://127.0.0.1:0", "shm://127.0.0.1:0"]
    with tensorwire.ServerThread(urls, extensions=[ps.ParamServer()]) as server:
        RelayCoordinator.of(server.server)  # as `tensorwire serve` has it
        bound = {address.scheme: str(address) for address in server.addresses}
        # A worker finds its servers, rank and world size in the environment (torchrun, ps launch).
        monkeypatch.setenv("TENSORWIRE_SERVERS", bound["tcp"])
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        code = EXAMPLE_URL.sub(lambda m: bound[m.group(1)], code)
        namespace: dict[str, Any] = {"torch": torch, "tensorwire": tensorwire, "ps": ps, "url": bound["tcp"]}
        namespace.update(GIVEN[heading]())
        # Blank lines first, so that a traceback names the README's own line numbers.
        exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)
