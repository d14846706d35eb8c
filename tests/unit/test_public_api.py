"""The public API holds: every public ``__all__`` is the curated surface below (nothing lost, no
internal slipped in) and resolves, the names deprecated in issue 33 still work and warn, and the
README's Python examples run as written against a real server."""

from __future__ import annotations

import importlib
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tensorwire
from tensorwire import ps
from tensorwire.broadcast.coordinator import RelayCoordinator

README = Path(__file__).resolve().parents[2] / "README.md"

# The curated public names (issue 14, narrowed in issue 33): a package's ``__all__`` is exactly its
# set here, so a name is added on purpose, and one leaves only through DEPRECATED below. The test
# kit (``tensorwire.testing``) may add names freely, never lose one.
PUBLIC: dict[str, set[str]] = {
    "tensorwire": {
        "Address", "AsyncClient", "Client", "ClientOptions", "Limits", "Security", "Server", "ServerOptions",
        "ServerThread", "TensorMeta", "TensorStore", "TlsFiles", "__version__", "aconnect", "connect",
        "errors", "Generation", "GenerationManifest", "HostReader", "Subscriber",
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
    "tensorwire.compression": {"Cast", "Codec", "ErrorFeedback", "Int8", "Sign", "TopK", "codec_for"},
    "tensorwire.sharded": {
        "AsyncSaver", "Box", "ShardLayout", "async_save", "layout_of", "load_state_dict",
        "load_training_state", "put_state_dict", "training_state",
    },
    "tensorwire.broadcast": {"HostReader", "HostShare", "Subscriber"},
    "tensorwire.store": {"Entry", "Reservation", "TensorStore"},
    "tensorwire.transport": {
        "CHANNEL_SCHEMES", "ByteStream", "FrameChannel", "Listener", "Ranged", "Transport",
        "TransportOptions", "check_channel", "check_scheme", "connect_stream", "listen", "local_listener",
        "open_channel", "open_ranged", "open_transport",
    },
    # The public test kit: what the tests (and other projects' transports) import from it.
    "tensorwire.testing.conformance": {
        "CASES", "RPC_CASES", "SCHEMES", "STREAM_CASES", "STREAM_SCHEMES", "Case", "Harness",
        "random_tensor", "run_case", "same_bytes", "put_frame", "raw", "read_reply",
        "corrupt_get_response_is_retried",
    },
    "tensorwire.testing.process": {"ServerProcess", "run_threads", "wait_for"},
}  # fmt: skip


# Names that left a package's ``__all__`` in issue 33 (internals), by package: each still imports
# from the package for one release, with a DeprecationWarning that names its module.
DEPRECATED: dict[str, dict[str, str]] = {
    "tensorwire.compression": dict.fromkeys(
        ["decode_all", "from_wire", "payload_total", "resolve", "top_indices"],
        "tensorwire.compression.codecs",
    ),
    "tensorwire.store": {"validate_name": "tensorwire.wire.names"},
    "tensorwire.broadcast": {
        "Chains": "tensorwire.broadcast.chains",
        "RelayCoordinator": "tensorwire.broadcast.coordinator",
        "RelayPeer": "tensorwire.broadcast.peer",
    },
}
# Functions renamed in issue 33 (old -> new): the old name stays one release and warns when called
# (tests/unit/test_sharded_checkpoint.py calls them).
RENAMED: dict[str, dict[str, str]] = {
    "tensorwire.sharded": {"get_state_dict": "load_state_dict", "save_async": "async_save"},
}
# Defined in the module itself, so importable as before (no warning), but no longer star-imported.
UNEXPORTED = {"tensorwire.transport": {"LOCAL_FALLBACKS", "STREAMS", "TRANSPORTS"}}


@pytest.mark.parametrize("module_name", sorted(PUBLIC))
def test_every_public_name_resolves(module_name: str) -> None:
    module = importlib.import_module(module_name)
    exported = list(module.__all__)
    assert len(exported) == len(set(exported)), f"{module_name}.__all__ names a name twice"
    missing = [name for name in exported if not hasattr(module, name)]
    assert not missing, f"{module_name}.__all__ names what it does not have: {missing}"
    lost = PUBLIC[module_name] - set(exported)
    assert not lost, f"{module_name} no longer exports {sorted(lost)}"
    added = set(exported) - PUBLIC[module_name]
    assert module_name.startswith("tensorwire.testing.") or not added, (
        f"{module_name} exports {sorted(added)}: add them to PUBLIC if they are for users"
    )
    namespace: dict[str, Any] = {}
    exec(f"from {module_name} import *", namespace)  # the star import a user may write works too
    assert set(exported) <= set(namespace)


@pytest.mark.parametrize(
    ("module_name", "name"), sorted((module, name) for module, names in DEPRECATED.items() for name in names)
)
def test_a_name_that_left_all_still_imports_and_warns(module_name: str, name: str) -> None:
    home = DEPRECATED[module_name][name]
    with pytest.warns(DeprecationWarning, match=re.escape(f"import it from {home}")):
        namespace: dict[str, Any] = {}
        exec(f"from {module_name} import {name}", namespace)
    assert namespace[name] is getattr(importlib.import_module(home), name)
    assert name not in importlib.import_module(module_name).__all__


def test_the_renamed_functions_are_aliases_of_the_new_ones() -> None:
    for module_name, names in RENAMED.items():
        module = importlib.import_module(module_name)
        for old, new in names.items():
            assert getattr(module, old).__wrapped__ is getattr(module, new)
            assert old not in module.__all__


def test_internals_defined_in_a_package_import_without_a_warning() -> None:
    for module_name, names in UNEXPORTED.items():
        module = importlib.import_module(module_name)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert all(getattr(module, name) is not None for name in names)
        assert not names & set(module.__all__)


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    import tensorwire.broadcast

    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        tensorwire.broadcast.Nothing  # noqa: B018


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
    "Checkpoints with torch.distributed.checkpoint": dict,  # DCP without a process group: one rank
    "Ray Direct Transport": dict,  # starts (and shuts down) a local Ray cluster of its own
    "Hugging Face models": dict,  # builds a tiny model from a config
}
# Examples that start a Ray cluster run on the worker that runs the other Ray tests, one at a time,
# and are slow (over 2 s: the cluster, transformers' import) like every test that starts one.
RAY_EXAMPLES = frozenset({"Ray Direct Transport"})
SLOW_EXAMPLES = frozenset({"Ray Direct Transport", "Hugging Face models"})
BROKEN: dict[str, str] = {}  # examples that do not run as written, and why: strict, so a fix shows up
EXAMPLE_URL = re.compile(r"\b([a-z]+)://127\.0\.0\.1:\d+")
EXAMPLE_TIMEOUT = 120  # seconds for one example (most take well under one; Ray's ~20)


def _examples() -> list[Any]:
    params = []
    for heading, line, code in python_blocks(README.read_text()):
        marks = []
        if heading in BROKEN:
            marks.append(pytest.mark.xfail(strict=True, raises=AttributeError, reason=BROKEN[heading]))
        if heading in RAY_EXAMPLES:
            marks.append(pytest.mark.xdist_group("ray"))
        if heading in SLOW_EXAMPLES:
            marks.append(pytest.mark.slow)
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
