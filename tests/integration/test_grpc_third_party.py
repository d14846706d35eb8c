"""A client written the way a third party would: its own copy of the two-call schema, stubs
generated from it, and nothing from tensorwire. It runs in its own process, as it would in real
life (its generated messages share proto names with tensorwire's own)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tensorwire.testing.process import ServerProcess

SCHEMA = """
syntax = "proto3";
package tensor_service;
service TensorService {
  rpc UploadTensor(TensorRequest) returns (TensorResponse);
  rpc DownloadTensor(TensorRequest) returns (TensorResponse);
}
message TensorRequest { string tensor_name = 1; bytes data = 2; repeated int64 shape = 3; string dtype = 4; }
message TensorResponse {
  bool success = 1; string message = 2; bytes data = 3; repeated int64 shape = 4; string dtype = 5;
}
"""

CLIENT = """
import json, sys
import grpc, numpy as np
from grpc_tools import protoc
out = sys.argv[2]
args = ["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}", "their.proto"]
assert protoc.main(args) == 0
sys.path.insert(0, out)
import their_pb2 as pb, their_pb2_grpc as pb_grpc

channel = grpc.insecure_channel(sys.argv[1])
grpc.channel_ready_future(channel).result(timeout=10)
stub = pb_grpc.TensorServiceStub(channel)
results = {}
for dtype in ("float32", "int64"):
    array = (np.arange(24, dtype=dtype) * 3 - 7).reshape(2, 3, 4)
    up = stub.UploadTensor(pb.TensorRequest(tensor_name=f"third/{dtype}", data=array.tobytes(),
                                            shape=array.shape, dtype=dtype), timeout=10)
    down = stub.DownloadTensor(pb.TensorRequest(tensor_name=f"third/{dtype}"), timeout=10)
    same = np.array_equal(np.frombuffer(down.data, dtype=down.dtype).reshape(down.shape), array)
    results[dtype] = [up.success, up.message, down.success, down.dtype, list(down.shape), bool(same)]
bad = {
    "size": dict(tensor_name="third/x", data=b"\\0" * 8, shape=[3], dtype="float32"),
    "dtype": dict(tensor_name="third/x", data=b"\\0" * 4, shape=[1], dtype="float128"),
    "segment": dict(tensor_name="../escape", data=b"\\0" * 4, shape=[1], dtype="float32"),
    "capacity": dict(tensor_name="third/huge", data=b"\\0" * (2 << 20), shape=[2 << 20], dtype="uint8"),
}
for reason, fields in bad.items():
    reply = stub.UploadTensor(pb.TensorRequest(**fields), timeout=10)
    results[reason] = [reply.success, reply.message]
missing = stub.DownloadTensor(pb.TensorRequest(tensor_name="third/nope"), timeout=10)
results["missing"] = [missing.success, missing.message]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("third_party")
    (out / "their.proto").write_text(SCHEMA)
    (out / "client.py").write_text(CLIENT)
    with ServerProcess(capacity="1MiB", extra=["--grpc-listen", "127.0.0.1:0"]) as srv:
        target = srv.urls[1].removeprefix("grpc://")
        done = subprocess.run(
            [sys.executable, str(out / "client.py"), target, str(out)],
            capture_output=True, text=True, timeout=60, cwd=out, check=False,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    yield json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_upload_and_download(results: dict[str, Any], dtype: str) -> None:
    up_ok, message, down_ok, got_dtype, shape, same = results[dtype]
    assert up_ok, message
    assert down_ok and got_dtype == dtype and shape == [2, 3, 4] and same


@pytest.mark.parametrize("reason", ["size", "dtype", "segment", "capacity"])
def test_refusals_are_success_false_with_a_message(results: dict[str, Any], reason: str) -> None:
    ok, message = results[reason]
    assert not ok and reason in message.lower(), message


def test_missing_tensor(results: dict[str, Any]) -> None:
    ok, message = results["missing"]
    assert not ok and "no tensor named" in message
