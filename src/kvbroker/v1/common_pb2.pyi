from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_1: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_2: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_3: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_4: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_5: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_6: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_7: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_8: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_9: _ClassVar[ProtocolVersion]

class RoomState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROOM_STATE_FAILED: _ClassVar[RoomState]
    ROOM_STATE_BOOTSTRAPPING: _ClassVar[RoomState]
    ROOM_STATE_WAITING_FOR_INPUT: _ClassVar[RoomState]
    ROOM_STATE_TRANSFERRING: _ClassVar[RoomState]
    ROOM_STATE_SUCCESS: _ClassVar[RoomState]

class RoomPriority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROOM_PRIORITY_UNSPECIFIED: _ClassVar[RoomPriority]
    ROOM_PRIORITY_BULK: _ClassVar[RoomPriority]
    ROOM_PRIORITY_STANDARD: _ClassVar[RoomPriority]
    ROOM_PRIORITY_INTERACTIVE: _ClassVar[RoomPriority]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]

class RegionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_KIND_UNSPECIFIED: _ClassVar[RegionKind]
    REGION_KIND_KEY: _ClassVar[RegionKind]
    REGION_KIND_VALUE: _ClassVar[RegionKind]
    REGION_KIND_MLA: _ClassVar[RegionKind]
    REGION_KIND_AUX: _ClassVar[RegionKind]
    REGION_KIND_STATE: _ClassVar[RegionKind]
    REGION_KIND_KV: _ClassVar[RegionKind]

class KvLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LAYOUT_NHD: _ClassVar[KvLayout]
    KV_LAYOUT_HND_FUSED: _ClassVar[KvLayout]

class StateType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_TYPE_UNSPECIFIED: _ClassVar[StateType]
    STATE_TYPE_MAMBA: _ClassVar[StateType]
    STATE_TYPE_SWA: _ClassVar[StateType]
    STATE_TYPE_NSA: _ClassVar[StateType]

class FailureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_KIND_UNSPECIFIED: _ClassVar[FailureKind]
    FAILURE_KIND_ABORTED: _ClassVar[FailureKind]
    FAILURE_KIND_TIMEOUT: _ClassVar[FailureKind]
    FAILURE_KIND_PEER: _ClassVar[FailureKind]
    FAILURE_KIND_TRANSFER: _ClassVar[FailureKind]
    FAILURE_KIND_MISMATCH: _ClassVar[FailureKind]
    FAILURE_KIND_ENGINE_LOST: _ClassVar[FailureKind]
    FAILURE_KIND_UNKNOWN_ROOM: _ClassVar[FailureKind]
    FAILURE_KIND_SHUTDOWN: _ClassVar[FailureKind]
    FAILURE_KIND_REFUSED: _ClassVar[FailureKind]
    FAILURE_KIND_BROKER_LOST: _ClassVar[FailureKind]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_1: ProtocolVersion
PROTOCOL_VERSION_2: ProtocolVersion
PROTOCOL_VERSION_3: ProtocolVersion
PROTOCOL_VERSION_4: ProtocolVersion
PROTOCOL_VERSION_5: ProtocolVersion
PROTOCOL_VERSION_6: ProtocolVersion
PROTOCOL_VERSION_7: ProtocolVersion
PROTOCOL_VERSION_8: ProtocolVersion
PROTOCOL_VERSION_9: ProtocolVersion
ROOM_STATE_FAILED: RoomState
ROOM_STATE_BOOTSTRAPPING: RoomState
ROOM_STATE_WAITING_FOR_INPUT: RoomState
ROOM_STATE_TRANSFERRING: RoomState
ROOM_STATE_SUCCESS: RoomState
ROOM_PRIORITY_UNSPECIFIED: RoomPriority
ROOM_PRIORITY_BULK: RoomPriority
ROOM_PRIORITY_STANDARD: RoomPriority
ROOM_PRIORITY_INTERACTIVE: RoomPriority
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_BOTH: Role
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind
REGION_KIND_UNSPECIFIED: RegionKind
REGION_KIND_KEY: RegionKind
REGION_KIND_VALUE: RegionKind
REGION_KIND_MLA: RegionKind
REGION_KIND_AUX: RegionKind
REGION_KIND_STATE: RegionKind
REGION_KIND_KV: RegionKind
KV_LAYOUT_NHD: KvLayout
KV_LAYOUT_HND_FUSED: KvLayout
STATE_TYPE_UNSPECIFIED: StateType
STATE_TYPE_MAMBA: StateType
STATE_TYPE_SWA: StateType
STATE_TYPE_NSA: StateType
FAILURE_KIND_UNSPECIFIED: FailureKind
FAILURE_KIND_ABORTED: FailureKind
FAILURE_KIND_TIMEOUT: FailureKind
FAILURE_KIND_PEER: FailureKind
FAILURE_KIND_TRANSFER: FailureKind
FAILURE_KIND_MISMATCH: FailureKind
FAILURE_KIND_ENGINE_LOST: FailureKind
FAILURE_KIND_UNKNOWN_ROOM: FailureKind
FAILURE_KIND_SHUTDOWN: FailureKind
FAILURE_KIND_REFUSED: FailureKind
FAILURE_KIND_BROKER_LOST: FailureKind

class RoomTimeouts(_message.Message):
    __slots__ = ("sender_info_seconds", "bootstrap_seconds", "receiver_data_seconds")
    SENDER_INFO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_DATA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    sender_info_seconds: float
    bootstrap_seconds: float
    receiver_data_seconds: float
    def __init__(self, sender_info_seconds: _Optional[float] = ..., bootstrap_seconds: _Optional[float] = ..., receiver_data_seconds: _Optional[float] = ...) -> None: ...

class FailureCause(_message.Message):
    __slots__ = ("kind", "message", "origin_broker")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_BROKER_FIELD_NUMBER: _ClassVar[int]
    kind: FailureKind
    message: str
    origin_broker: str
    def __init__(self, kind: _Optional[_Union[FailureKind, str]] = ..., message: _Optional[str] = ..., origin_broker: _Optional[str] = ...) -> None: ...

class EngineRankId(_message.Message):
    __slots__ = ("group", "tp_rank", "pp_rank")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    group: str
    tp_rank: int
    pp_rank: int
    def __init__(self, group: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ...) -> None: ...

class BufferSpec(_message.Message):
    __slots__ = ("size_bytes", "kind", "device_id", "device_uuid", "cuda_ipc_handle")
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    kind: MemoryKind
    device_id: int
    device_uuid: bytes
    cuda_ipc_handle: bytes
    def __init__(self, size_bytes: _Optional[int] = ..., kind: _Optional[_Union[MemoryKind, str]] = ..., device_id: _Optional[int] = ..., device_uuid: _Optional[bytes] = ..., cuda_ipc_handle: _Optional[bytes] = ...) -> None: ...

class Region(_message.Message):
    __slots__ = ("kind", "buffer", "offset_bytes", "length_bytes", "item_bytes", "layer_id", "component")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENGTH_BYTES_FIELD_NUMBER: _ClassVar[int]
    ITEM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_ID_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    kind: RegionKind
    buffer: int
    offset_bytes: int
    length_bytes: int
    item_bytes: int
    layer_id: int
    component: str
    def __init__(self, kind: _Optional[_Union[RegionKind, str]] = ..., buffer: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., length_bytes: _Optional[int] = ..., item_bytes: _Optional[int] = ..., layer_id: _Optional[int] = ..., component: _Optional[str] = ...) -> None: ...

class StateComponent(_message.Message):
    __slots__ = ("name", "type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    type: StateType
    def __init__(self, name: _Optional[str] = ..., type: _Optional[_Union[StateType, str]] = ...) -> None: ...

class EngineLayout(_message.Message):
    __slots__ = ("role", "tp_size", "pp_size", "num_layers", "layer_begin", "layer_end", "page_size_tokens", "total_kv_heads", "kv_heads_per_rank", "head_dim", "dtype", "mla", "regions", "state_components", "pp_layer_begins", "kv_layout", "kv_layers", "compatibility")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MLA_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    PP_LAYER_BEGINS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYERS_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_FIELD_NUMBER: _ClassVar[int]
    role: Role
    tp_size: int
    pp_size: int
    num_layers: int
    layer_begin: int
    layer_end: int
    page_size_tokens: int
    total_kv_heads: int
    kv_heads_per_rank: int
    head_dim: int
    dtype: str
    mla: bool
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    state_components: _containers.RepeatedCompositeFieldContainer[StateComponent]
    pp_layer_begins: _containers.RepeatedScalarFieldContainer[int]
    kv_layout: KvLayout
    kv_layers: _containers.RepeatedScalarFieldContainer[int]
    compatibility: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., page_size_tokens: _Optional[int] = ..., total_kv_heads: _Optional[int] = ..., kv_heads_per_rank: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., mla: _Optional[bool] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., state_components: _Optional[_Iterable[_Union[StateComponent, _Mapping]]] = ..., pp_layer_begins: _Optional[_Iterable[int]] = ..., kv_layout: _Optional[_Union[KvLayout, str]] = ..., kv_layers: _Optional[_Iterable[int]] = ..., compatibility: _Optional[str] = ...) -> None: ...

class PageIndices(_message.Message):
    __slots__ = ("packed", "values")
    PACKED_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    packed: bytes
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, packed: _Optional[bytes] = ..., values: _Optional[_Iterable[int]] = ...) -> None: ...

class StateIndices(_message.Message):
    __slots__ = ("component", "indices")
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    component: str
    indices: PageIndices
    def __init__(self, component: _Optional[str] = ..., indices: _Optional[_Union[PageIndices, _Mapping]] = ...) -> None: ...

class RoomStatus(_message.Message):
    __slots__ = ("room", "state", "cause", "pages_settled", "chunks", "bytes", "prefix_pages", "landed_pages", "waiting_for", "priority")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    PAGES_SETTLED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PAGES_FIELD_NUMBER: _ClassVar[int]
    LANDED_PAGES_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    room: int
    state: RoomState
    cause: FailureCause
    pages_settled: bool
    chunks: int
    bytes: int
    prefix_pages: int
    landed_pages: PageIndices
    waiting_for: str
    priority: RoomPriority
    def __init__(self, room: _Optional[int] = ..., state: _Optional[_Union[RoomState, str]] = ..., cause: _Optional[_Union[FailureCause, _Mapping]] = ..., pages_settled: _Optional[bool] = ..., chunks: _Optional[int] = ..., bytes: _Optional[int] = ..., prefix_pages: _Optional[int] = ..., landed_pages: _Optional[_Union[PageIndices, _Mapping]] = ..., waiting_for: _Optional[str] = ..., priority: _Optional[_Union[RoomPriority, str]] = ...) -> None: ...
