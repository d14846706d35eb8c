"""tensorwire and a program's own stubs of the same schema in one process (issue 13, item 18).

A training script that generated ``train_pb2`` and ``tensor_service_pb2`` from its own copies of
the seeds' protos, then imports tensorwire (or the other way round), used to crash at import with
``duplicate symbol 'train.GradientRequest'``: both registered the same proto names in protobuf's
default descriptor pool. Each check runs in a fresh interpreter, since the pool is per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TRAIN_PROTO = """
syntax = "proto3";
package train;
service GradientService { rpc UpdateGradient(GradientRequest) returns (GradientResponse); }
message GradientRequest { bytes gradient = 1; }
message GradientResponse { bytes updated_gradient = 1; }
"""

TENSOR_PROTO = """
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

# argv: the stubs' folder, then "user-first" or "tensorwire-first".
PROGRAM = """
import json, sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "user-first":
    import train_pb2, train_pb2_grpc, tensor_service_pb2, tensor_service_pb2_grpc
    import tensorwire, tensorwire.server.rpc, tensorwire.transport.rpc, tensorwire.ps.exchange.server
else:
    import tensorwire, tensorwire.server.rpc, tensorwire.transport.rpc, tensorwire.ps.exchange.server
    import train_pb2, train_pb2_grpc, tensor_service_pb2, tensor_service_pb2_grpc
import grpc, torch
from tensorwire.ps import ParamServer
from tensorwire.server import ServerThread

out = {}
with ServerThread(["grpc://127.0.0.1:0"], extensions=[ParamServer()]) as srv:
    target = srv.url.removeprefix("grpc://")
    with grpc.insecure_channel(target) as channel:
        tensors = tensor_service_pb2_grpc.TensorServiceStub(channel)
        data = torch.arange(6, dtype=torch.float32)
        up = tensors.UploadTensor(tensor_service_pb2.TensorRequest(
            tensor_name="user/x", data=data.numpy().tobytes(), shape=[6], dtype="float32"), timeout=10)
        with tensorwire.connect(srv.url) as client:
            out["tensorwire_get"] = client.get("user/x").tolist()
            client.put("tw/y", torch.full((3,), 7, dtype=torch.int64))
        down = tensors.DownloadTensor(tensor_service_pb2.TensorRequest(tensor_name="tw/y"), timeout=10)
        out["upload"] = up.success
        out["user_download"] = [down.success, down.dtype, list(down.shape)]
        gradients = train_pb2_grpc.GradientServiceStub(channel)
        grad = torch.tensor([1.5, -2.0])
        metadata = [("worker-id", "0"), ("step", "0"), ("tensor-name", "w"), ("world-size", "1")]
        reply = gradients.UpdateGradient(
            train_pb2.GradientRequest(gradient=grad.numpy().tobytes()), metadata=metadata, timeout=10)
        out["gradient"] = torch.frombuffer(bytearray(reply.updated_gradient), dtype=torch.float32).tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def stubs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from grpc_tools import protoc

    out: Path = tmp_path_factory.mktemp("user_stubs")
    (out / "train.proto").write_text(TRAIN_PROTO)
    (out / "tensor_service.proto").write_text(TENSOR_PROTO)
    (out / "program.py").write_text(PROGRAM)
    args = ["protoc", f"-I{out}", f"--python_out={out}", f"--grpc_python_out={out}", "train.proto",
            "tensor_service.proto"]  # fmt: skip
    assert protoc.main([*args[:4], *(str(out / p) for p in args[4:])]) == 0
    return out


@pytest.mark.parametrize("order", ["user-first", "tensorwire-first"])
def test_user_stubs_and_tensorwire_share_a_process(stubs: Path, order: str) -> None:
    done = subprocess.run(
        [sys.executable, str(stubs / "program.py"), str(stubs), order],
        capture_output=True, text=True, timeout=90, cwd=stubs, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {
        "tensorwire_get": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        "upload": True,
        "user_download": [True, "int64", [3]],
        "gradient": [1.5, -2.0],
    }
