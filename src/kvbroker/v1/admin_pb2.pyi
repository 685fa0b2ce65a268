from kvbroker.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("broker_id", "per_room_state", "engines", "peers", "rooms_succeeded", "rooms_failed", "bytes_sent", "bytes_received", "transfers_posted", "uptime_seconds", "descriptors_transferred", "late_notices", "bad_notices", "staging_send_bytes_in_use", "staging_receive_bytes_in_use", "transfers_staged", "transfers_per_token", "draining", "open_rooms", "checksum_mismatches", "transfers_token_runs", "etcd", "transfers_packed", "device_launches", "peer_calls_answered", "packed_checksums_checked", "queues", "packed_parts_taken_off_loop")
    class PerRoomStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PeerCallsAnsweredEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    PER_ROOM_STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    ROOMS_SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_POSTED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_TRANSFERRED_FIELD_NUMBER: _ClassVar[int]
    LATE_NOTICES_FIELD_NUMBER: _ClassVar[int]
    BAD_NOTICES_FIELD_NUMBER: _ClassVar[int]
    STAGING_SEND_BYTES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    STAGING_RECEIVE_BYTES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_STAGED_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROOMS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_TOKEN_RUNS_FIELD_NUMBER: _ClassVar[int]
    ETCD_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_PACKED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    PEER_CALLS_ANSWERED_FIELD_NUMBER: _ClassVar[int]
    PACKED_CHECKSUMS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    PACKED_PARTS_TAKEN_OFF_LOOP_FIELD_NUMBER: _ClassVar[int]
    broker_id: str
    per_room_state: _containers.ScalarMap[str, int]
    engines: int
    peers: int
    rooms_succeeded: int
    rooms_failed: int
    bytes_sent: int
    bytes_received: int
    transfers_posted: int
    uptime_seconds: int
    descriptors_transferred: int
    late_notices: int
    bad_notices: int
    staging_send_bytes_in_use: int
    staging_receive_bytes_in_use: int
    transfers_staged: int
    transfers_per_token: int
    draining: bool
    open_rooms: int
    checksum_mismatches: int
    transfers_token_runs: int
    etcd: str
    transfers_packed: int
    device_launches: int
    peer_calls_answered: _containers.ScalarMap[str, int]
    packed_checksums_checked: int
    queues: _containers.RepeatedCompositeFieldContainer[QueueStats]
    packed_parts_taken_off_loop: int
    def __init__(self, broker_id: _Optional[str] = ..., per_room_state: _Optional[_Mapping[str, int]] = ..., engines: _Optional[int] = ..., peers: _Optional[int] = ..., rooms_succeeded: _Optional[int] = ..., rooms_failed: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., transfers_posted: _Optional[int] = ..., uptime_seconds: _Optional[int] = ..., descriptors_transferred: _Optional[int] = ..., late_notices: _Optional[int] = ..., bad_notices: _Optional[int] = ..., staging_send_bytes_in_use: _Optional[int] = ..., staging_receive_bytes_in_use: _Optional[int] = ..., transfers_staged: _Optional[int] = ..., transfers_per_token: _Optional[int] = ..., draining: _Optional[bool] = ..., open_rooms: _Optional[int] = ..., checksum_mismatches: _Optional[int] = ..., transfers_token_runs: _Optional[int] = ..., etcd: _Optional[str] = ..., transfers_packed: _Optional[int] = ..., device_launches: _Optional[int] = ..., peer_calls_answered: _Optional[_Mapping[str, int]] = ..., packed_checksums_checked: _Optional[int] = ..., queues: _Optional[_Iterable[_Union[QueueStats, _Mapping]]] = ..., packed_parts_taken_off_loop: _Optional[int] = ...) -> None: ...

class QueueStats(_message.Message):
    __slots__ = ("queue", "priority", "engine", "waiting", "served", "bytes", "waited_seconds")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WAITED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue: str
    priority: _common_pb2.RoomPriority
    engine: str
    waiting: int
    served: int
    bytes: int
    waited_seconds: float
    def __init__(self, queue: _Optional[str] = ..., priority: _Optional[_Union[_common_pb2.RoomPriority, str]] = ..., engine: _Optional[str] = ..., waiting: _Optional[int] = ..., served: _Optional[int] = ..., bytes: _Optional[int] = ..., waited_seconds: _Optional[float] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("engine_label", "rank", "role", "buffers", "registered_bytes", "regions", "open_rooms", "timeouts", "memory_warming")
    ENGINE_LABEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROOMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_WARMING_FIELD_NUMBER: _ClassVar[int]
    engine_label: str
    rank: _common_pb2.EngineRankId
    role: _common_pb2.Role
    buffers: int
    registered_bytes: int
    regions: int
    open_rooms: int
    timeouts: _common_pb2.RoomTimeouts
    memory_warming: bool
    def __init__(self, engine_label: _Optional[str] = ..., rank: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., buffers: _Optional[int] = ..., registered_bytes: _Optional[int] = ..., regions: _Optional[int] = ..., open_rooms: _Optional[int] = ..., timeouts: _Optional[_Union[_common_pb2.RoomTimeouts, _Mapping]] = ..., memory_warming: _Optional[bool] = ...) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines", "fleet_groups")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    FLEET_GROUPS_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    fleet_groups: _containers.RepeatedCompositeFieldContainer[FleetGroup]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ..., fleet_groups: _Optional[_Iterable[_Union[FleetGroup, _Mapping]]] = ...) -> None: ...

class FleetGroup(_message.Message):
    __slots__ = ("group", "role", "tp_size", "pp_size", "ranks", "broker_id", "address")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    group: str
    role: str
    tp_size: int
    pp_size: int
    ranks: _containers.RepeatedScalarFieldContainer[str]
    broker_id: str
    address: str
    def __init__(self, group: _Optional[str] = ..., role: _Optional[str] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., ranks: _Optional[_Iterable[str]] = ..., broker_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class FleetBroker(_message.Message):
    __slots__ = ("broker_id", "address", "protocol", "version", "started_at", "lease_ttl_seconds", "lease_granted_seconds", "draining", "groups", "usable", "transports")
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_GRANTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    USABLE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    broker_id: str
    address: str
    protocol: int
    version: str
    started_at: float
    lease_ttl_seconds: int
    lease_granted_seconds: int
    draining: bool
    groups: _containers.RepeatedCompositeFieldContainer[FleetGroup]
    usable: bool
    transports: _containers.RepeatedCompositeFieldContainer[TransportProbe]
    def __init__(self, broker_id: _Optional[str] = ..., address: _Optional[str] = ..., protocol: _Optional[int] = ..., version: _Optional[str] = ..., started_at: _Optional[float] = ..., lease_ttl_seconds: _Optional[int] = ..., lease_granted_seconds: _Optional[int] = ..., draining: _Optional[bool] = ..., groups: _Optional[_Iterable[_Union[FleetGroup, _Mapping]]] = ..., usable: _Optional[bool] = ..., transports: _Optional[_Iterable[_Union[TransportProbe, _Mapping]]] = ...) -> None: ...

class ListPeersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("address", "broker_id", "nixl_agent_name", "handshaken", "engines", "open_rooms", "transport", "memory", "bytes_sent", "throughput_gbps", "last_seen_seconds", "transports", "stream_open", "stream_calls", "stream_frames", "silent", "state")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKEN_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROOMS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_GBPS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    STREAM_OPEN_FIELD_NUMBER: _ClassVar[int]
    STREAM_CALLS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    SILENT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    address: str
    broker_id: str
    nixl_agent_name: str
    handshaken: bool
    engines: int
    open_rooms: int
    transport: str
    memory: _containers.RepeatedScalarFieldContainer[str]
    bytes_sent: int
    throughput_gbps: float
    last_seen_seconds: float
    transports: _containers.RepeatedCompositeFieldContainer[TransportProbe]
    stream_open: bool
    stream_calls: int
    stream_frames: int
    silent: bool
    state: str
    def __init__(self, address: _Optional[str] = ..., broker_id: _Optional[str] = ..., nixl_agent_name: _Optional[str] = ..., handshaken: _Optional[bool] = ..., engines: _Optional[int] = ..., open_rooms: _Optional[int] = ..., transport: _Optional[str] = ..., memory: _Optional[_Iterable[str]] = ..., bytes_sent: _Optional[int] = ..., throughput_gbps: _Optional[float] = ..., last_seen_seconds: _Optional[float] = ..., transports: _Optional[_Iterable[_Union[TransportProbe, _Mapping]]] = ..., stream_open: _Optional[bool] = ..., stream_calls: _Optional[int] = ..., stream_frames: _Optional[int] = ..., silent: _Optional[bool] = ..., state: _Optional[str] = ...) -> None: ...

class TransportProbe(_message.Message):
    __slots__ = ("local", "remote", "verdict", "gbps", "floor_gbps", "bytes", "writes", "age_seconds")
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    GBPS_FIELD_NUMBER: _ClassVar[int]
    FLOOR_GBPS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    local: str
    remote: str
    verdict: str
    gbps: float
    floor_gbps: float
    bytes: int
    writes: int
    age_seconds: float
    def __init__(self, local: _Optional[str] = ..., remote: _Optional[str] = ..., verdict: _Optional[str] = ..., gbps: _Optional[float] = ..., floor_gbps: _Optional[float] = ..., bytes: _Optional[int] = ..., writes: _Optional[int] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class ProbeTransportRequest(_message.Message):
    __slots__ = ("peer",)
    PEER_FIELD_NUMBER: _ClassVar[int]
    peer: str
    def __init__(self, peer: _Optional[str] = ...) -> None: ...

class ProbeTransportResponse(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    def __init__(self, peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ...) -> None: ...

class ListPeersResponse(_message.Message):
    __slots__ = ("peers", "fleet")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    FLEET_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    fleet: _containers.RepeatedCompositeFieldContainer[FleetBroker]
    def __init__(self, peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., fleet: _Optional[_Iterable[_Union[FleetBroker, _Mapping]]] = ...) -> None: ...

class ListRoomsRequest(_message.Message):
    __slots__ = ("state", "engine", "peer")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    state: _common_pb2.RoomState
    engine: str
    peer: str
    def __init__(self, state: _Optional[_Union[_common_pb2.RoomState, str]] = ..., engine: _Optional[str] = ..., peer: _Optional[str] = ...) -> None: ...

class RoomInfo(_message.Message):
    __slots__ = ("room", "side", "engine", "state", "cause", "peer", "pages", "chunks", "bytes", "age_seconds")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    room: int
    side: str
    engine: _common_pb2.EngineRankId
    state: _common_pb2.RoomState
    cause: _common_pb2.FailureCause
    peer: str
    pages: int
    chunks: int
    bytes: int
    age_seconds: float
    def __init__(self, room: _Optional[int] = ..., side: _Optional[str] = ..., engine: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., state: _Optional[_Union[_common_pb2.RoomState, str]] = ..., cause: _Optional[_Union[_common_pb2.FailureCause, _Mapping]] = ..., peer: _Optional[str] = ..., pages: _Optional[int] = ..., chunks: _Optional[int] = ..., bytes: _Optional[int] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class ListRoomsResponse(_message.Message):
    __slots__ = ("rooms",)
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    rooms: _containers.RepeatedCompositeFieldContainer[RoomInfo]
    def __init__(self, rooms: _Optional[_Iterable[_Union[RoomInfo, _Mapping]]] = ...) -> None: ...

class GetRoomRequest(_message.Message):
    __slots__ = ("room",)
    ROOM_FIELD_NUMBER: _ClassVar[int]
    room: int
    def __init__(self, room: _Optional[int] = ...) -> None: ...

class TimelineEvent(_message.Message):
    __slots__ = ("event", "at")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    event: str
    at: float
    def __init__(self, event: _Optional[str] = ..., at: _Optional[float] = ...) -> None: ...

class SourceProgress(_message.Message):
    __slots__ = ("source", "mode", "chunks_landed", "total_chunks", "complete", "settled")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_LANDED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    source: _common_pb2.EngineRankId
    mode: str
    chunks_landed: int
    total_chunks: int
    complete: bool
    settled: bool
    def __init__(self, source: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., mode: _Optional[str] = ..., chunks_landed: _Optional[int] = ..., total_chunks: _Optional[int] = ..., complete: _Optional[bool] = ..., settled: _Optional[bool] = ...) -> None: ...

class DestinationProgress(_message.Message):
    __slots__ = ("receiver", "receiver_broker_id", "mode", "chunks_posted", "inflight", "complete")
    RECEIVER_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_POSTED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    receiver: _common_pb2.EngineRankId
    receiver_broker_id: str
    mode: str
    chunks_posted: int
    inflight: int
    complete: bool
    def __init__(self, receiver: _Optional[_Union[_common_pb2.EngineRankId, _Mapping]] = ..., receiver_broker_id: _Optional[str] = ..., mode: _Optional[str] = ..., chunks_posted: _Optional[int] = ..., inflight: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class RoomDetail(_message.Message):
    __slots__ = ("info", "pages_settled", "timeline", "trace_id", "sources", "destinations", "waiting_for")
    INFO_FIELD_NUMBER: _ClassVar[int]
    PAGES_SETTLED_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    info: RoomInfo
    pages_settled: bool
    timeline: _containers.RepeatedCompositeFieldContainer[TimelineEvent]
    trace_id: str
    sources: _containers.RepeatedCompositeFieldContainer[SourceProgress]
    destinations: _containers.RepeatedCompositeFieldContainer[DestinationProgress]
    waiting_for: str
    def __init__(self, info: _Optional[_Union[RoomInfo, _Mapping]] = ..., pages_settled: _Optional[bool] = ..., timeline: _Optional[_Iterable[_Union[TimelineEvent, _Mapping]]] = ..., trace_id: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[SourceProgress, _Mapping]]] = ..., destinations: _Optional[_Iterable[_Union[DestinationProgress, _Mapping]]] = ..., waiting_for: _Optional[str] = ...) -> None: ...

class GetRoomResponse(_message.Message):
    __slots__ = ("sides",)
    SIDES_FIELD_NUMBER: _ClassVar[int]
    sides: _containers.RepeatedCompositeFieldContainer[RoomDetail]
    def __init__(self, sides: _Optional[_Iterable[_Union[RoomDetail, _Mapping]]] = ...) -> None: ...

class AdminAbortRoomRequest(_message.Message):
    __slots__ = ("room", "reason")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    room: int
    reason: str
    def __init__(self, room: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AdminAbortRoomResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: int
    def __init__(self, aborted: _Optional[int] = ...) -> None: ...

class ForgetPeerRequest(_message.Message):
    __slots__ = ("peer", "reason")
    PEER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    peer: str
    reason: str
    def __init__(self, peer: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ForgetPeerResponse(_message.Message):
    __slots__ = ("address", "broker_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    broker_id: str
    def __init__(self, address: _Optional[str] = ..., broker_id: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("wait", "timeout_seconds", "resume")
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    wait: bool
    timeout_seconds: float
    resume: bool
    def __init__(self, wait: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ..., resume: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining", "open_rooms", "drained")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROOMS_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    open_rooms: int
    drained: bool
    def __init__(self, draining: _Optional[bool] = ..., open_rooms: _Optional[int] = ..., drained: _Optional[bool] = ...) -> None: ...
