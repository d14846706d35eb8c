"""The committed gRPC files are what `make proto` makes from the schema today, and the message
classes built from them are the schema's."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

from tensorwire.v1 import gradient_service_pb2, tensor_service_pb2

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ("tensor_service", "gradient_service")
GENERATED = ["schema.binpb"] + [
    f"{schema}{suffix}" for schema in SCHEMAS for suffix in ("_pb2.pyi", "_pb2_grpc.py")
]


def test_generated_files_are_not_stale(tmp_path: Path) -> None:
    out = tmp_path / "tensorwire/v1"
    out.mkdir(parents=True)
    args = [
        "protoc", f"-I{ROOT / 'proto'}", "--include_imports", f"--descriptor_set_out={out / 'schema.binpb'}",
        f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
        *(str(ROOT / f"proto/tensorwire/v1/{schema}.proto") for schema in SCHEMAS),
    ]  # fmt: skip
    assert protoc.main(args) == 0
    for name in GENERATED:
        fresh = (out / name).read_bytes()
        committed = (ROOT / "src/tensorwire/v1" / name).read_bytes()
        assert fresh == committed, f"src/tensorwire/v1/{name} is stale: run `make proto` and commit it"


def test_the_message_classes_are_the_schemas() -> None:
    """Every message and enum of each file is in its module, with the schema's full names."""
    for module in (tensor_service_pb2, gradient_service_pb2):
        file = module.DESCRIPTOR
        for name, message in file.message_types_by_name.items():
            assert getattr(module, name).DESCRIPTOR.full_name == message.full_name
        for name in file.enum_types_by_name:
            assert getattr(module, name).keys()
    assert gradient_service_pb2.GradientRequest.DESCRIPTOR.full_name == "train.GradientRequest"
    assert tensor_service_pb2.XXH3_64 == tensor_service_pb2.ChecksumKind.Value("XXH3_64") == 1
