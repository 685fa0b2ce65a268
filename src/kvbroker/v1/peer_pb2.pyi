from kvbroker.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SourceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_MODE_UNSPECIFIED: _ClassVar[SourceMode]
    SOURCE_MODE_FULL_PAGES: _ClassVar[SourceMode]
    SOURCE_MODE_COMPLETION_ONLY: _ClassVar[SourceMode]
    SOURCE_MODE_HEAD_SLICE: _ClassVar[SourceMode]
SOURCE_MODE_UNSPECIFIED: SourceMode
SOURCE_MODE_FULL_PAGES: SourceMode
SOURCE_MODE_COMPLETION_ONLY: SourceMode
SOURCE_MODE_HEAD_SLICE: SourceMode

class PeerFrame(_message.Message):
    __slots__ = ("open", "calls", "answers")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    open: StreamOpen
    calls: _containers.RepeatedCompositeFieldContainer[PeerCall]
    answers: _containers.RepeatedCompositeFieldContainer[PeerAnswer]
    def __init__(self, open: _Optional[_Union[StreamOpen, _Mapping]] = ..., calls: _Optional[_Iterable[_Union[PeerCall, _Mapping]]] = ..., answers: _Optional[_Iterable[_Union[PeerAnswer, _Mapping]]] = ...) -> None: ...

class StreamOpen(_message.Message):
    __slots__ = ("protocol_version", "broker_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    broker_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., broker_id: _Optional[str] = ...) -> None: ...

class PeerCall(_message.Message):
    __slots__ = ("id", "trace_context", "register_rooms", "reserve_staging", "report_completion", "abort_rooms", "ping", "grant_credits", "return_credits", "renew_leases")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    REGISTER_ROOMS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_STAGING_FIELD_NUMBER: _ClassVar[int]
    REPORT_COMPLETION_FIELD_NUMBER: _ClassVar[int]
    ABORT_ROOMS_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    GRANT_CREDITS_FIELD_NUMBER: _ClassVar[int]
    RETURN_CREDITS_FIELD_NUMBER: _ClassVar[int]
    RENEW_LEASES_FIELD_NUMBER: _ClassVar[int]
    id: int
    trace_context: _containers.ScalarMap[str, str]
    register_rooms: RegisterRoomsRequest
    reserve_staging: ReserveStagingRequest
    report_completion: CompletionReport
    abort_rooms: PeerAbortRoomsRequest
    ping: PingRequest
    grant_credits: GrantCreditsRequest
    return_credits: ReturnCreditsRequest
    renew_leases: RenewLeasesRequest
    def __init__(self, id: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., register_rooms: _Optional[_Union[RegisterRoomsRequest, _Mapping]] = ..., reserve_staging: _Optional[_Union[ReserveStagingRequest, _Mapping]] = ..., report_completion: _Optional[_Union[CompletionReport, _Mapping]] = ..., abort_rooms: _Optional[_Union[PeerAbortRoomsRequest, _Mapping]] = ..., ping: _Optional[_Union[PingRequest, _Mapping]] = ..., grant_credits: _Optional[_Union[GrantCreditsRequest, _Mapping]] = ..., return_credits: _Optional[_Union[ReturnCreditsRequest, _Mapping]] = ..., renew_leases: _Optional[_Union[RenewLeasesRequest, _Mapping]] = ...) -> None: ...

class PeerAnswer(_message.Message):
    __slots__ = ("id", "code", "message", "register_rooms", "reserve_staging", "report_completion", "abort_rooms", "ping", "grant_credits", "return_credits", "renew_leases")
    ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REGISTER_ROOMS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_STAGING_FIELD_NUMBER: _ClassVar[int]
    REPORT_COMPLETION_FIELD_NUMBER: _ClassVar[int]
    ABORT_ROOMS_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    GRANT_CREDITS_FIELD_NUMBER: _ClassVar[int]
    RETURN_CREDITS_FIELD_NUMBER: _ClassVar[int]
    RENEW_LEASES_FIELD_NUMBER: _ClassVar[int]
    id: int
    code: int
    message: str
    register_rooms: RegisterRoomsResponse
    reserve_staging: ReserveStagingResponse
    report_completion: CompletionAck
    abort_rooms: PeerAbortRoomsResponse
    ping: PingResponse
    grant_credits: GrantCreditsResponse
    return_credits: ReturnCreditsResponse
    renew_leases: RenewLeasesResponse
    def __init__(self, id: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., register_rooms: _Optional[_Union[RegisterRoomsResponse, _Mapping]] = ..., reserve_staging: _Optional[_Union[ReserveStagingResponse, _Mapping]] = ..., report_completion: _Optional[_Union[CompletionAck, _Mapping]] = ..., abort_rooms: _Optional[_Union[PeerAbortRoomsResponse, _Mapping]] = ..., ping: _Optional[_Union[PingResponse, _Mapping]] = ..., grant_credits: _Optional[_Union[GrantCreditsResponse, _Mapping]] = ..., return_credits: _Optional[_Union[ReturnCreditsResponse, _Mapping]] = ..., renew_leases: _Optional[_Union[RenewLeasesResponse, _Mapping]] = ...) -> None: ...

class BrokerIdentity(_message.Message):
    __slots__ = ("broker_id", "nixl_agent_name", "address")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    broker_id: str
    nixl_agent_name: str
    address: str
    def __init__(self, broker_id: _Optional[str] = ..., nixl_agent_name: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RemoteBuffer(_message.Message):
    __slots__ = ("address", "size_bytes", "kind", "device_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    address: int
    size_bytes: int
    kind: _common_pb2.MemoryKind
    device_id: int
    def __init__(self, address: _Optional[int] = ..., size_bytes: _Optional[int] = ..., kind: _Optional[_Union[_common_pb2.MemoryKind, str]] = ..., device_id: _Optional[int] = ...) -> None: ...

class EngineDescriptor(_message.Message):
    __slots__ = ("rank", "layout", "buffers", "generation")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    rank: _common_pb2.EngineRankId
    layout: _common_pb2.EngineLayout
    buffers: _containers.RepeatedCompositeFieldContainer[RemoteBuffer]
    generation: int
    def __init__(self, rank: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., layout: _Optional[_Union[_common_pb2.EngineLayout, _Mapping]] = ..., buffers: _Optional[_Iterable[_Union[RemoteBuffer, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("protocol_version", "caller", "nixl_agent_metadata", "engines", "staging", "receive_staging")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_STAGING_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    caller: BrokerIdentity
    nixl_agent_metadata: bytes
    engines: _containers.RepeatedCompositeFieldContainer[EngineDescriptor]
    staging: RemoteBuffer
    receive_staging: _containers.RepeatedCompositeFieldContainer[RemoteBuffer]
    def __init__(self, protocol_version: _Optional[int] = ..., caller: _Optional[_Union[BrokerIdentity, _Mapping]] = ..., nixl_agent_metadata: _Optional[bytes] = ..., engines: _Optional[_Iterable[_Union[EngineDescriptor, _Mapping]]] = ..., staging: _Optional[_Union[RemoteBuffer, _Mapping]] = ..., receive_staging: _Optional[_Iterable[_Union[RemoteBuffer, _Mapping]]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("protocol_version", "callee", "nixl_agent_metadata", "engines", "staging", "receive_staging")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CALLEE_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_STAGING_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    callee: BrokerIdentity
    nixl_agent_metadata: bytes
    engines: _containers.RepeatedCompositeFieldContainer[EngineDescriptor]
    staging: RemoteBuffer
    receive_staging: _containers.RepeatedCompositeFieldContainer[RemoteBuffer]
    def __init__(self, protocol_version: _Optional[int] = ..., callee: _Optional[_Union[BrokerIdentity, _Mapping]] = ..., nixl_agent_metadata: _Optional[bytes] = ..., engines: _Optional[_Iterable[_Union[EngineDescriptor, _Mapping]]] = ..., staging: _Optional[_Union[RemoteBuffer, _Mapping]] = ..., receive_staging: _Optional[_Iterable[_Union[RemoteBuffer, _Mapping]]] = ...) -> None: ...

class SourcePlan(_message.Message):
    __slots__ = ("rank", "mode", "num_destinations", "layer_begin", "layer_end", "sends_aux", "sends_state", "src_head_start", "dst_head_start", "num_heads")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    NUM_DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SENDS_AUX_FIELD_NUMBER: _ClassVar[int]
    SENDS_STATE_FIELD_NUMBER: _ClassVar[int]
    SRC_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    DST_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    rank: _common_pb2.EngineRankId
    mode: SourceMode
    num_destinations: int
    layer_begin: int
    layer_end: int
    sends_aux: bool
    sends_state: bool
    src_head_start: int
    dst_head_start: int
    num_heads: int
    def __init__(self, rank: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., mode: _Optional[_Union[SourceMode, str]] = ..., num_destinations: _Optional[int] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., sends_aux: _Optional[bool] = ..., sends_state: _Optional[bool] = ..., src_head_start: _Optional[int] = ..., dst_head_start: _Optional[int] = ..., num_heads: _Optional[int] = ...) -> None: ...

class RegisterRoomRequest(_message.Message):
    __slots__ = ("room", "receiver_broker_id", "receiver", "receiver_generation", "sender_group", "pages", "aux_row", "state", "sources", "sender_broker_id", "protocol_version", "trace_context", "prefix_pages", "verify_checksum", "priority", "deadline_ms")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROOM_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SENDER_GROUP_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    AUX_ROW_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SENDER_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PAGES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    room: int
    receiver_broker_id: str
    receiver: _common_pb2.EngineRankId
    receiver_generation: int
    sender_group: str
    pages: _common_pb2.PageIndices
    aux_row: int
    state: _containers.RepeatedCompositeFieldContainer[_common_pb2.StateIndices]
    sources: _containers.RepeatedCompositeFieldContainer[SourcePlan]
    sender_broker_id: str
    protocol_version: int
    trace_context: _containers.ScalarMap[str, str]
    prefix_pages: int
    verify_checksum: bool
    priority: _common_pb2.RoomPriority
    deadline_ms: int
    def __init__(self, room: _Optional[int] = ..., receiver_broker_id: _Optional[str] = ..., receiver: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., receiver_generation: _Optional[int] = ..., sender_group: _Optional[str] = ..., pages: _Optional[_Union[_common_pb2.PageIndices, _Mapping]] = ..., aux_row: _Optional[int] = ..., state: _Optional[_Iterable[_Union[_common_pb2.StateIndices, _Mapping]]] = ..., sources: _Optional[_Iterable[_Union[SourcePlan, _Mapping]]] = ..., sender_broker_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., prefix_pages: _Optional[int] = ..., verify_checksum: _Optional[bool] = ..., priority: _Optional[_Union[_common_pb2.RoomPriority, str]] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class RegisterRoomsRequest(_message.Message):
    __slots__ = ("protocol_version", "rooms")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    rooms: _containers.RepeatedCompositeFieldContainer[RegisterRoomRequest]
    def __init__(self, protocol_version: _Optional[int] = ..., rooms: _Optional[_Iterable[_Union[RegisterRoomRequest, _Mapping]]] = ...) -> None: ...

class RegisterRoomsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RegistrationResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RegistrationResult, _Mapping]]] = ...) -> None: ...

class RegistrationResult(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ReserveStagingRequest(_message.Message):
    __slots__ = ("room", "sender_broker_id", "source", "receiver", "chunk_index", "part", "bytes", "protocol_version")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    SENDER_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    room: int
    sender_broker_id: str
    source: _common_pb2.EngineRankId
    receiver: _common_pb2.EngineRankId
    chunk_index: int
    part: int
    bytes: int
    protocol_version: int
    def __init__(self, room: _Optional[int] = ..., sender_broker_id: _Optional[str] = ..., source: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., receiver: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., chunk_index: _Optional[int] = ..., part: _Optional[int] = ..., bytes: _Optional[int] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class ReserveStagingResponse(_message.Message):
    __slots__ = ("offset", "bytes", "buffer")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    offset: int
    bytes: int
    buffer: RemoteBuffer
    def __init__(self, offset: _Optional[int] = ..., bytes: _Optional[int] = ..., buffer: _Optional[_Union[RemoteBuffer, _Mapping]] = ...) -> None: ...

class ReserveProbeRequest(_message.Message):
    __slots__ = ("protocol_version", "sender_broker_id", "kind", "device_id", "bytes")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SENDER_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    sender_broker_id: str
    kind: _common_pb2.MemoryKind
    device_id: int
    bytes: int
    def __init__(self, protocol_version: _Optional[int] = ..., sender_broker_id: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.MemoryKind, str]] = ..., device_id: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class ReserveProbeResponse(_message.Message):
    __slots__ = ("probe_id", "offset", "bytes", "buffer", "lease_seconds")
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    probe_id: str
    offset: int
    bytes: int
    buffer: RemoteBuffer
    lease_seconds: float
    def __init__(self, probe_id: _Optional[str] = ..., offset: _Optional[int] = ..., bytes: _Optional[int] = ..., buffer: _Optional[_Union[RemoteBuffer, _Mapping]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class ReleaseProbeRequest(_message.Message):
    __slots__ = ("protocol_version", "probe_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    probe_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., probe_id: _Optional[str] = ...) -> None: ...

class ReleaseProbeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompletionReport(_message.Message):
    __slots__ = ("room", "sender_broker_id", "source", "receiver", "failure", "settled", "protocol_version")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    SENDER_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    room: int
    sender_broker_id: str
    source: _common_pb2.EngineRankId
    receiver: _common_pb2.EngineRankId
    failure: _common_pb2.FailureCause
    settled: bool
    protocol_version: int
    def __init__(self, room: _Optional[int] = ..., sender_broker_id: _Optional[str] = ..., source: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., receiver: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., failure: _Optional[_Union[_common_pb2.FailureCause, _Mapping]] = ..., settled: _Optional[bool] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class CompletionAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerAbortRequest(_message.Message):
    __slots__ = ("room", "from_broker_id", "cause", "protocol_version")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    FROM_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    room: int
    from_broker_id: str
    cause: _common_pb2.FailureCause
    protocol_version: int
    def __init__(self, room: _Optional[int] = ..., from_broker_id: _Optional[str] = ..., cause: _Optional[_Union[_common_pb2.FailureCause, _Mapping]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class PeerAbortResponse(_message.Message):
    __slots__ = ("settled",)
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    settled: bool
    def __init__(self, settled: _Optional[bool] = ...) -> None: ...

class PeerAbortRoomsRequest(_message.Message):
    __slots__ = ("protocol_version", "aborts")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORTS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    aborts: _containers.RepeatedCompositeFieldContainer[PeerAbortRequest]
    def __init__(self, protocol_version: _Optional[int] = ..., aborts: _Optional[_Iterable[_Union[PeerAbortRequest, _Mapping]]] = ...) -> None: ...

class PeerAbortRoomsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PeerAbortResult]
    def __init__(self, results: _Optional[_Iterable[_Union[PeerAbortResult, _Mapping]]] = ...) -> None: ...

class PeerAbortResult(_message.Message):
    __slots__ = ("code", "message", "settled")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    settled: bool
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., settled: _Optional[bool] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("from_broker_id",)
    FROM_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    from_broker_id: str
    def __init__(self, from_broker_id: _Optional[str] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("broker_id",)
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    broker_id: str
    def __init__(self, broker_id: _Optional[str] = ...) -> None: ...

class TransferNotice(_message.Message):
    __slots__ = ("room", "sender_broker_id", "source", "receiver", "chunk_index", "is_last", "total_chunks", "pages", "bytes", "aux", "state_components", "part", "parts", "page_offset", "staged", "staging_offset", "staging_bytes", "protocol_version", "checksum", "token_begin", "token_end", "packed", "packed_kv_begin", "packed_kv_end", "packed_aux", "packed_state", "packed_checksum", "kv_packed", "aux_packed", "credit_id")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    SENDER_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    IS_LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    AUX_FIELD_NUMBER: _ClassVar[int]
    STATE_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    STAGING_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BEGIN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    PACKED_KV_BEGIN_FIELD_NUMBER: _ClassVar[int]
    PACKED_KV_END_FIELD_NUMBER: _ClassVar[int]
    PACKED_AUX_FIELD_NUMBER: _ClassVar[int]
    PACKED_STATE_FIELD_NUMBER: _ClassVar[int]
    PACKED_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    KV_PACKED_FIELD_NUMBER: _ClassVar[int]
    AUX_PACKED_FIELD_NUMBER: _ClassVar[int]
    CREDIT_ID_FIELD_NUMBER: _ClassVar[int]
    room: int
    sender_broker_id: str
    source: _common_pb2.EngineRankId
    receiver: _common_pb2.EngineRankId
    chunk_index: int
    is_last: bool
    total_chunks: int
    pages: int
    bytes: int
    aux: bool
    state_components: _containers.RepeatedScalarFieldContainer[str]
    part: int
    parts: int
    page_offset: int
    staged: bool
    staging_offset: int
    staging_bytes: int
    protocol_version: int
    checksum: int
    token_begin: int
    token_end: int
    packed: bool
    packed_kv_begin: int
    packed_kv_end: int
    packed_aux: bool
    packed_state: _containers.RepeatedCompositeFieldContainer[PackedState]
    packed_checksum: int
    kv_packed: bool
    aux_packed: bool
    credit_id: int
    def __init__(self, room: _Optional[int] = ..., sender_broker_id: _Optional[str] = ..., source: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., receiver: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., chunk_index: _Optional[int] = ..., is_last: _Optional[bool] = ..., total_chunks: _Optional[int] = ..., pages: _Optional[int] = ..., bytes: _Optional[int] = ..., aux: _Optional[bool] = ..., state_components: _Optional[_Iterable[str]] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ..., page_offset: _Optional[int] = ..., staged: _Optional[bool] = ..., staging_offset: _Optional[int] = ..., staging_bytes: _Optional[int] = ..., protocol_version: _Optional[int] = ..., checksum: _Optional[int] = ..., token_begin: _Optional[int] = ..., token_end: _Optional[int] = ..., packed: _Optional[bool] = ..., packed_kv_begin: _Optional[int] = ..., packed_kv_end: _Optional[int] = ..., packed_aux: _Optional[bool] = ..., packed_state: _Optional[_Iterable[_Union[PackedState, _Mapping]]] = ..., packed_checksum: _Optional[int] = ..., kv_packed: _Optional[bool] = ..., aux_packed: _Optional[bool] = ..., credit_id: _Optional[int] = ...) -> None: ...

class CreditReturn(_message.Message):
    __slots__ = ("protocol_version", "credits", "pressure")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    credits: _containers.RepeatedCompositeFieldContainer[ReturnedCredit]
    pressure: bool
    def __init__(self, protocol_version: _Optional[int] = ..., credits: _Optional[_Iterable[_Union[ReturnedCredit, _Mapping]]] = ..., pressure: _Optional[bool] = ...) -> None: ...

class ReturnedCredit(_message.Message):
    __slots__ = ("credit_id", "kind", "device_id", "offset", "bytes")
    CREDIT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    credit_id: int
    kind: _common_pb2.MemoryKind
    device_id: int
    offset: int
    bytes: int
    def __init__(self, credit_id: _Optional[int] = ..., kind: _Optional[_Union[_common_pb2.MemoryKind, str]] = ..., device_id: _Optional[int] = ..., offset: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class GrantCreditsRequest(_message.Message):
    __slots__ = ("protocol_version", "sender_broker_id", "kind", "device_id", "bytes")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SENDER_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    sender_broker_id: str
    kind: _common_pb2.MemoryKind
    device_id: int
    bytes: int
    def __init__(self, protocol_version: _Optional[int] = ..., sender_broker_id: _Optional[str] = ..., kind: _Optional[_Union[_common_pb2.MemoryKind, str]] = ..., device_id: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class GrantCreditsResponse(_message.Message):
    __slots__ = ("grant_id", "offset", "bytes", "buffer")
    GRANT_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    grant_id: str
    offset: int
    bytes: int
    buffer: RemoteBuffer
    def __init__(self, grant_id: _Optional[str] = ..., offset: _Optional[int] = ..., bytes: _Optional[int] = ..., buffer: _Optional[_Union[RemoteBuffer, _Mapping]] = ...) -> None: ...

class ReturnCreditsRequest(_message.Message):
    __slots__ = ("protocol_version", "sender_broker_id", "grant_ids")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SENDER_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    GRANT_IDS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    sender_broker_id: str
    grant_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., sender_broker_id: _Optional[str] = ..., grant_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReturnCreditsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PackedState(_message.Message):
    __slots__ = ("component", "items")
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    component: str
    items: int
    def __init__(self, component: _Optional[str] = ..., items: _Optional[int] = ...) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("protocol_version", "receiver_broker_id", "rooms")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    receiver_broker_id: str
    rooms: _containers.RepeatedCompositeFieldContainer[LeasedRoom]
    def __init__(self, protocol_version: _Optional[int] = ..., receiver_broker_id: _Optional[str] = ..., rooms: _Optional[_Iterable[_Union[LeasedRoom, _Mapping]]] = ...) -> None: ...

class LeasedRoom(_message.Message):
    __slots__ = ("room", "sender_group")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    SENDER_GROUP_FIELD_NUMBER: _ClassVar[int]
    room: int
    sender_group: str
    def __init__(self, room: _Optional[int] = ..., sender_group: _Optional[str] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("lease_seconds", "renewed")
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    renewed: int
    def __init__(self, lease_seconds: _Optional[float] = ..., renewed: _Optional[int] = ...) -> None: ...
