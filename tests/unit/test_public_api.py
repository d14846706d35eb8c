"""The public API holds: every public ``__all__`` is the curated surface below (nothing lost, no
internal slipped in) and resolves, and the names deprecated in issue 33 still work and warn.
(The README's and the docs' examples run in tests/integration/test_doc_examples.py.)"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

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
        "SGD", "Adam", "AdamW", "CheckpointPolicy", "Coordination", "ExchangeClient", "JobConfig", "Mode",
        "OptimizerSpec", "ParamServer",
        "ParamSpec", "Placement", "PushResult", "Shard", "Worker", "plan", "pull_parameters",
    },
    "tensorwire.dataset": {
        "Digest", "DigestService", "FetchReport", "NodeReport", "Plan", "ScatterReport", "ShardDataset",
        "fetch", "make_plan", "scatter",
    },
    "tensorwire.coordinator": {
        "COORDINATORS", "DEFAULT_TIMEOUT", "Coordinator", "InSync", "Leader", "Term", "open_coordinator",
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
    "tensorwire.testing.process": {
        "ServerProcess", "param_server_of", "ps_role", "ps_stats", "run_threads", "wait_for",
    },
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
