"""The gRPC schema's Python side (``make proto`` from proto/tensorwire/v1).

``schema.binpb`` (the schema as a FileDescriptorSet), the ``*_pb2.pyi`` types and the
``*_pb2_grpc.py`` stubs are generated: do not edit them. The ``*_pb2.py`` modules are not
protoc's: they build the message classes in tensorwire's own descriptor pool (``_pool``), so
that a program's own stubs of the same schema never clash with them.
"""
