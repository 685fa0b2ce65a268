from kvbroker.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetBrokerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BrokerInfo(_message.Message):
    __slots__ = ("broker_id", "protocol_version", "version", "fd_socket_path", "engine_socket_path", "listen_address", "nixl_agent_name")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    LISTEN_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    broker_id: str
    protocol_version: int
    version: str
    fd_socket_path: str
    engine_socket_path: str
    listen_address: str
    nixl_agent_name: str
    def __init__(self, broker_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., version: _Optional[str] = ..., fd_socket_path: _Optional[str] = ..., engine_socket_path: _Optional[str] = ..., listen_address: _Optional[str] = ..., nixl_agent_name: _Optional[str] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("session_token", "rank", "layout", "timeouts")
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    session_token: str
    rank: _common_pb2.EngineRankId
    layout: _common_pb2.EngineLayout
    timeouts: _common_pb2.RoomTimeouts
    def __init__(self, session_token: _Optional[str] = ..., rank: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., layout: _Optional[_Union[_common_pb2.EngineLayout, _Mapping]] = ..., timeouts: _Optional[_Union[_common_pb2.RoomTimeouts, _Mapping]] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class UnregisterEngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class UnregisterEngineResponse(_message.Message):
    __slots__ = ("rooms_failed",)
    ROOMS_FAILED_FIELD_NUMBER: _ClassVar[int]
    rooms_failed: int
    def __init__(self, rooms_failed: _Optional[int] = ...) -> None: ...

class SenderRef(_message.Message):
    __slots__ = ("broker_address", "group")
    BROKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    broker_address: str
    group: str
    def __init__(self, broker_address: _Optional[str] = ..., group: _Optional[str] = ...) -> None: ...

class ExpectRoomRequest(_message.Message):
    __slots__ = ("engine_id", "room", "sender", "pages", "aux_row", "state", "prefix_pages", "verify_checksum", "priority", "deadline_ms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    AUX_ROW_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PAGES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    room: int
    sender: SenderRef
    pages: _common_pb2.PageIndices
    aux_row: int
    state: _containers.RepeatedCompositeFieldContainer[_common_pb2.StateIndices]
    prefix_pages: int
    verify_checksum: bool
    priority: _common_pb2.RoomPriority
    deadline_ms: int
    def __init__(self, engine_id: _Optional[str] = ..., room: _Optional[int] = ..., sender: _Optional[_Union[SenderRef, _Mapping]] = ..., pages: _Optional[_Union[_common_pb2.PageIndices, _Mapping]] = ..., aux_row: _Optional[int] = ..., state: _Optional[_Iterable[_Union[_common_pb2.StateIndices, _Mapping]]] = ..., prefix_pages: _Optional[int] = ..., verify_checksum: _Optional[bool] = ..., priority: _Optional[_Union[_common_pb2.RoomPriority, str]] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class ExpectRoomResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.RoomStatus
    def __init__(self, status: _Optional[_Union[_common_pb2.RoomStatus, _Mapping]] = ...) -> None: ...

class BeginSendRequest(_message.Message):
    __slots__ = ("engine_id", "room", "num_pages", "priority", "deadline_ms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    room: int
    num_pages: int
    priority: _common_pb2.RoomPriority
    deadline_ms: int
    def __init__(self, engine_id: _Optional[str] = ..., room: _Optional[int] = ..., num_pages: _Optional[int] = ..., priority: _Optional[_Union[_common_pb2.RoomPriority, str]] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class BeginSendResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.RoomStatus
    def __init__(self, status: _Optional[_Union[_common_pb2.RoomStatus, _Mapping]] = ...) -> None: ...

class SendChunkRequest(_message.Message):
    __slots__ = ("engine_id", "room", "pages", "is_last", "aux_row", "state", "room_page")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    AUX_ROW_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROOM_PAGE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    room: int
    pages: _common_pb2.PageIndices
    is_last: bool
    aux_row: int
    state: _containers.RepeatedCompositeFieldContainer[_common_pb2.StateIndices]
    room_page: int
    def __init__(self, engine_id: _Optional[str] = ..., room: _Optional[int] = ..., pages: _Optional[_Union[_common_pb2.PageIndices, _Mapping]] = ..., is_last: _Optional[bool] = ..., aux_row: _Optional[int] = ..., state: _Optional[_Iterable[_Union[_common_pb2.StateIndices, _Mapping]]] = ..., room_page: _Optional[int] = ...) -> None: ...

class SendChunkResponse(_message.Message):
    __slots__ = ("chunk_index", "status")
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    chunk_index: int
    status: _common_pb2.RoomStatus
    def __init__(self, chunk_index: _Optional[int] = ..., status: _Optional[_Union[_common_pb2.RoomStatus, _Mapping]] = ...) -> None: ...

class PollRequest(_message.Message):
    __slots__ = ("engine_id", "rooms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    rooms: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., rooms: _Optional[_Iterable[int]] = ...) -> None: ...

class PollResponse(_message.Message):
    __slots__ = ("statuses",)
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedCompositeFieldContainer[_common_pb2.RoomStatus]
    def __init__(self, statuses: _Optional[_Iterable[_Union[_common_pb2.RoomStatus, _Mapping]]] = ...) -> None: ...

class WatchRoomsRequest(_message.Message):
    __slots__ = ("engine_id", "rooms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    rooms: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., rooms: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("engine_id", "room", "reason")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    room: int
    reason: str
    def __init__(self, engine_id: _Optional[str] = ..., room: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: _common_pb2.RoomStatus
    def __init__(self, status: _Optional[_Union[_common_pb2.RoomStatus, _Mapping]] = ...) -> None: ...

class AnnounceRoomRequest(_message.Message):
    __slots__ = ("engine_id", "room", "sender")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    room: int
    sender: SenderRef
    def __init__(self, engine_id: _Optional[str] = ..., room: _Optional[int] = ..., sender: _Optional[_Union[SenderRef, _Mapping]] = ...) -> None: ...

class AnnounceRoomResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "commands")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    open: SessionOpen
    commands: _containers.RepeatedCompositeFieldContainer[SessionCommand]
    def __init__(self, open: _Optional[_Union[SessionOpen, _Mapping]] = ..., commands: _Optional[_Iterable[_Union[SessionCommand, _Mapping]]] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("engine_id", "protocol_version", "resume_after", "rooms")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESUME_AFTER_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    protocol_version: int
    resume_after: int
    rooms: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., resume_after: _Optional[int] = ..., rooms: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionCommand(_message.Message):
    __slots__ = ("seq", "expect_room", "begin_send", "send_chunk", "abort", "announce_room", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EXPECT_ROOM_FIELD_NUMBER: _ClassVar[int]
    BEGIN_SEND_FIELD_NUMBER: _ClassVar[int]
    SEND_CHUNK_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_ROOM_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    expect_room: ExpectRoomRequest
    begin_send: BeginSendRequest
    send_chunk: SendChunkRequest
    abort: AbortRequest
    announce_room: AnnounceRoomRequest
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, seq: _Optional[int] = ..., expect_room: _Optional[_Union[ExpectRoomRequest, _Mapping]] = ..., begin_send: _Optional[_Union[BeginSendRequest, _Mapping]] = ..., send_chunk: _Optional[_Union[SendChunkRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ..., announce_room: _Optional[_Union[AnnounceRoomRequest, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("applied", "statuses", "refused")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    applied: int
    statuses: _containers.RepeatedCompositeFieldContainer[_common_pb2.RoomStatus]
    refused: _containers.RepeatedCompositeFieldContainer[CommandRefused]
    def __init__(self, applied: _Optional[int] = ..., statuses: _Optional[_Iterable[_Union[_common_pb2.RoomStatus, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[CommandRefused, _Mapping]]] = ...) -> None: ...

class CommandRefused(_message.Message):
    __slots__ = ("seq", "room", "code", "message", "room_failed", "pages_settled")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ROOM_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ROOM_FAILED_FIELD_NUMBER: _ClassVar[int]
    PAGES_SETTLED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    room: int
    code: int
    message: str
    room_failed: bool
    pages_settled: bool
    def __init__(self, seq: _Optional[int] = ..., room: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., room_failed: _Optional[bool] = ..., pages_settled: _Optional[bool] = ...) -> None: ...
