"""Seed 001's training loop, unchanged, against ``tensorwire serve`` (issue 13, item 17).

The seed's client is generated from its own ``train.proto`` and calls ``UpdateGradient`` once per
parameter with no call metadata at all. It used to be refused with INVALID_ARGUMENT. On a server
whose world is one worker (``--workers 1``, the default) such a call is a one-worker exchange:
the answer is the gradient itself. With more workers the error names the metadata to send.
The stubs are generated at test time from a copy of the seed's schema, in a process of their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tensorwire.testing.process import ServerProcess

SEED_TRAIN_PROTO = """
syntax = "proto3";
package train;
service GradientService {
  rpc UpdateGradient(GradientRequest) returns (GradientResponse);
}
message GradientRequest { bytes gradient = 1; }
message GradientResponse { bytes updated_gradient = 1; }
"""

# The seed's loop: a small model, one UpdateGradient per parameter, the answer as its gradient.
SEED_LOOP = """
import json, sys
import grpc, numpy as np
from grpc_tools import protoc
out = sys.argv[2]
assert protoc.main(["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}",
                    f"{out}/train.proto"]) == 0
sys.path.insert(0, out)
import train_pb2, train_pb2_grpc

rng = np.random.default_rng(1)
params = {"fc1.weight": rng.standard_normal((8, 4)), "fc1.bias": rng.standard_normal(8),
          "fc2.weight": rng.standard_normal((2, 8))}
result = {"same": [], "error": None}
with grpc.insecure_channel(sys.argv[1]) as channel:
    stub = train_pb2_grpc.GradientServiceStub(channel)
    try:
        for step in range(3):
            for name, value in params.items():
                grad = (value * (step + 1)).astype(np.float32)
                reply = stub.UpdateGradient(train_pb2.GradientRequest(gradient=grad.tobytes()), timeout=10)
                back = np.frombuffer(reply.updated_gradient, dtype=np.float32).reshape(grad.shape)
                result["same"].append(bool(np.array_equal(back, grad)))
                params[name] = value - 0.1 * back
    except grpc.RpcError as exc:
        result["error"] = [exc.code().name, exc.details()]
print(json.dumps(result))
"""


def run_seed_loop(target: str, folder: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(folder / "seed_loop.py"), target, str(folder)],
        capture_output=True, text=True, timeout=90, cwd=folder, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def seed(tmp_path: Path) -> Path:
    (tmp_path / "train.proto").write_text(SEED_TRAIN_PROTO)
    (tmp_path / "seed_loop.py").write_text(SEED_LOOP)
    return tmp_path


def test_the_seed_loop_is_a_one_worker_exchange(seed: Path) -> None:
    with ServerProcess(capacity="64MiB", extra=["--grpc-listen", "127.0.0.1:0"]) as srv:
        result = run_seed_loop(srv.urls[1].removeprefix("grpc://"), seed)
    assert result == {"same": [True] * 9, "error": None}


def test_without_metadata_a_larger_world_names_the_metadata_to_send(seed: Path) -> None:
    extra = ["--grpc-listen", "127.0.0.1:0", "--workers", "2"]
    with ServerProcess(capacity="64MiB", extra=extra) as srv:
        result = run_seed_loop(srv.urls[1].removeprefix("grpc://"), seed)
    assert result["same"] == []
    code, details = result["error"]
    assert code == "INVALID_ARGUMENT"
    assert "worker-id, step, tensor-name" in details and "2 workers" in details
