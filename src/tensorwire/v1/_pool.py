"""tensorwire's own protobuf descriptor pool: the gRPC schema's message classes, kept out of
protobuf's process-wide default pool.

protoc's ``*_pb2.py`` modules register their messages in the default pool, and a name can be
registered there once per process. A training script that loads stubs it generated from its own
copy of the same schema (``train_pb2`` from the seeds' ``train.proto``, ``tensor_service_pb2``)
would then fail to import next to tensorwire with ``duplicate symbol 'train.GradientRequest'``.
So tensorwire builds its message classes from ``schema.binpb``, a ``FileDescriptorSet`` that
``make proto`` writes from proto/tensorwire/v1, in a pool of its own: the same proto names,
method paths and wire bytes, and no clash with anyone's stubs, whichever is imported first.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import enum_type_wrapper

SCHEMA_FILE = "schema.binpb"

POOL = descriptor_pool.DescriptorPool()


def _load() -> None:
    raw = resources.files(__package__).joinpath(SCHEMA_FILE).read_bytes()
    for file in descriptor_pb2.FileDescriptorSet.FromString(raw).file:
        POOL.AddSerializedFile(file.SerializeToString())


def namespace(proto_file: str) -> dict[str, Any]:
    """What protoc's module for ``proto_file`` defines at its top level: ``DESCRIPTOR``, a class
    per message, a wrapper per enum and a constant per enum value (the ``.pyi`` beside each
    module, also written by ``make proto``, gives their types)."""
    file = POOL.FindFileByName(proto_file)
    names: dict[str, Any] = {"DESCRIPTOR": file}
    for name, message in file.message_types_by_name.items():
        names[name] = message_factory.GetMessageClass(message)
    for name, enum in file.enum_types_by_name.items():
        names[name] = enum_type_wrapper.EnumTypeWrapper(enum)
        names.update((value.name, value.number) for value in enum.values)
    return names


_load()
