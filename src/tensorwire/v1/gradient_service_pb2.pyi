from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GradientRequest(_message.Message):
    __slots__ = ("gradient",)
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    gradient: bytes
    def __init__(self, gradient: _Optional[bytes] = ...) -> None: ...

class GradientResponse(_message.Message):
    __slots__ = ("updated_gradient",)
    UPDATED_GRADIENT_FIELD_NUMBER: _ClassVar[int]
    updated_gradient: bytes
    def __init__(self, updated_gradient: _Optional[bytes] = ...) -> None: ...
