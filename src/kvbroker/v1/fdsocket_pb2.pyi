from kvbroker.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FdUpload(_message.Message):
    __slots__ = ("buffers",)
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    buffers: _containers.RepeatedCompositeFieldContainer[_common_pb2.BufferSpec]
    def __init__(self, buffers: _Optional[_Iterable[_Union[_common_pb2.BufferSpec, _Mapping]]] = ...) -> None: ...

class FdUploadReply(_message.Message):
    __slots__ = ("session_token", "error")
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    session_token: str
    error: str
    def __init__(self, session_token: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...
