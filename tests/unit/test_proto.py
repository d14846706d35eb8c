"""The committed gRPC modules are what `make proto` makes from the schema today."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ("tensor_service", "gradient_service")
GENERATED = [f"{schema}{suffix}" for schema in SCHEMAS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def test_generated_modules_are_not_stale(tmp_path: Path) -> None:
    args = [
        "protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        *(str(ROOT / f"proto/tensorwire/v1/{schema}.proto") for schema in SCHEMAS),
    ]  # fmt: skip
    assert protoc.main(args) == 0
    for name in GENERATED:
        fresh = (tmp_path / "tensorwire/v1" / name).read_text()
        committed = (ROOT / "src/tensorwire/v1" / name).read_text()
        assert fresh == committed, f"src/tensorwire/v1/{name} is stale: run `make proto` and commit it"
