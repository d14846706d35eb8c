"""The messages of proto/tensorwire/v1/gradient_service.proto (package ``train``).

Not protoc's module of that name: these classes live in tensorwire's own descriptor pool
(``_pool``), so that stubs a program generates from the same schema (the seeds' ``train.proto``)
load beside them. The names, fields and wire bytes are protoc's; ``gradient_service_pb2.pyi``
(``make proto``) types them.
"""

from tensorwire.v1._pool import namespace

globals().update(namespace("tensorwire/v1/gradient_service.proto"))
