"""The messages of proto/tensorwire/v1/tensor_service.proto (package ``tensor_service``).

Not protoc's module of that name: these classes live in tensorwire's own descriptor pool
(``_pool``), so that stubs a program generates from the same schema load beside them. The names,
fields and wire bytes are protoc's; ``tensor_service_pb2.pyi`` (``make proto``) types them.
"""

from tensorwire.v1._pool import namespace

globals().update(namespace("tensorwire/v1/tensor_service.proto"))
