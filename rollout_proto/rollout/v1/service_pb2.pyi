from rollout_proto.rollout.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StalePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STALE_POLICY_UNSPECIFIED: _ClassVar[StalePolicy]
    STALE_POLICY_DROP: _ClassVar[StalePolicy]
    STALE_POLICY_MASK: _ClassVar[StalePolicy]
    STALE_POLICY_RECYCLE: _ClassVar[StalePolicy]

class PayloadMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAYLOAD_BYTES: _ClassVar[PayloadMode]
    PAYLOAD_PREFER_REFERENCE: _ClassVar[PayloadMode]
    PAYLOAD_REFERENCE: _ClassVar[PayloadMode]
STALE_POLICY_UNSPECIFIED: StalePolicy
STALE_POLICY_DROP: StalePolicy
STALE_POLICY_MASK: StalePolicy
STALE_POLICY_RECYCLE: StalePolicy
PAYLOAD_BYTES: PayloadMode
PAYLOAD_PREFER_REFERENCE: PayloadMode
PAYLOAD_REFERENCE: PayloadMode

class OpenStream(_message.Message):
    __slots__ = ("group", "consumer", "learner_version", "max_lag", "stale_policy", "payload")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    STALE_POLICY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    group: str
    consumer: str
    learner_version: int
    max_lag: int
    stale_policy: StalePolicy
    payload: PayloadMode
    def __init__(self, group: _Optional[str] = ..., consumer: _Optional[str] = ..., learner_version: _Optional[int] = ..., max_lag: _Optional[int] = ..., stale_policy: _Optional[_Union[StalePolicy, str]] = ..., payload: _Optional[_Union[PayloadMode, str]] = ...) -> None: ...

class CreditGrant(_message.Message):
    __slots__ = ("trajectories", "tokens", "learner_version", "max_lag")
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    trajectories: int
    tokens: int
    learner_version: int
    max_lag: int
    def __init__(self, trajectories: _Optional[int] = ..., tokens: _Optional[int] = ..., learner_version: _Optional[int] = ..., max_lag: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("open", "credit")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    open: OpenStream
    credit: CreditGrant
    def __init__(self, open: _Optional[_Union[OpenStream, _Mapping]] = ..., credit: _Optional[_Union[CreditGrant, _Mapping]] = ...) -> None: ...

class Delivery(_message.Message):
    __slots__ = ("entry_id", "delivery_count", "masked", "trajectory", "reference")
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    delivery_count: int
    masked: bool
    trajectory: _trajectory_pb2.Trajectory
    reference: StoreReference
    def __init__(self, entry_id: _Optional[str] = ..., delivery_count: _Optional[int] = ..., masked: _Optional[bool] = ..., trajectory: _Optional[_Union[_trajectory_pb2.Trajectory, _Mapping]] = ..., reference: _Optional[_Union[StoreReference, _Mapping]] = ...) -> None: ...

class StoreReference(_message.Message):
    __slots__ = ("kind", "key", "size", "trajectory_id", "num_tokens")
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    key: str
    size: int
    trajectory_id: str
    num_tokens: int
    def __init__(self, kind: _Optional[str] = ..., key: _Optional[str] = ..., size: _Optional[int] = ..., trajectory_id: _Optional[str] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("deliveries", "credit_trajectories", "credit_tokens")
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    CREDIT_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    CREDIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    deliveries: _containers.RepeatedCompositeFieldContainer[Delivery]
    credit_trajectories: int
    credit_tokens: int
    def __init__(self, deliveries: _Optional[_Iterable[_Union[Delivery, _Mapping]]] = ..., credit_trajectories: _Optional[int] = ..., credit_tokens: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("group", "entry_ids")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ENTRY_IDS_FIELD_NUMBER: _ClassVar[int]
    group: str
    entry_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group: _Optional[str] = ..., entry_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: int
    def __init__(self, acked: _Optional[int] = ...) -> None: ...

class NackRequest(_message.Message):
    __slots__ = ("group", "entry_ids", "reason")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ENTRY_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    group: str
    entry_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, group: _Optional[str] = ..., entry_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class NackResponse(_message.Message):
    __slots__ = ("requeued", "dead_lettered")
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    requeued: int
    dead_lettered: int
    def __init__(self, requeued: _Optional[int] = ..., dead_lettered: _Optional[int] = ...) -> None: ...

class ExtendLeaseRequest(_message.Message):
    __slots__ = ("group", "consumer", "entry_ids")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    ENTRY_IDS_FIELD_NUMBER: _ClassVar[int]
    group: str
    consumer: str
    entry_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group: _Optional[str] = ..., consumer: _Optional[str] = ..., entry_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ExtendLeaseResponse(_message.Message):
    __slots__ = ("extended", "lost", "lease_seconds")
    EXTENDED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    extended: int
    lost: _containers.RepeatedScalarFieldContainer[str]
    lease_seconds: float
    def __init__(self, extended: _Optional[int] = ..., lost: _Optional[_Iterable[str]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class CreateGroupRequest(_message.Message):
    __slots__ = ("group", "from_latest")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    FROM_LATEST_FIELD_NUMBER: _ClassVar[int]
    group: str
    from_latest: bool
    def __init__(self, group: _Optional[str] = ..., from_latest: _Optional[bool] = ...) -> None: ...

class CreateGroupResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class EngineVersion(_message.Message):
    __slots__ = ("engine_id", "version", "healthy")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    version: int
    healthy: bool
    def __init__(self, engine_id: _Optional[str] = ..., version: _Optional[int] = ..., healthy: _Optional[bool] = ...) -> None: ...

class StoreStatus(_message.Message):
    __slots__ = ("published", "duplicates", "backlog", "max_backlog", "stale_dropped", "stale_masked", "stale_recycled", "dead_lettered", "redelivered", "group_backlog", "lease_seconds")
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_FIELD_NUMBER: _ClassVar[int]
    MAX_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STALE_MASKED_FIELD_NUMBER: _ClassVar[int]
    STALE_RECYCLED_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_FIELD_NUMBER: _ClassVar[int]
    GROUP_BACKLOG_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    published: int
    duplicates: int
    backlog: int
    max_backlog: int
    stale_dropped: int
    stale_masked: int
    stale_recycled: int
    dead_lettered: int
    redelivered: int
    group_backlog: int
    lease_seconds: float
    def __init__(self, published: _Optional[int] = ..., duplicates: _Optional[int] = ..., backlog: _Optional[int] = ..., max_backlog: _Optional[int] = ..., stale_dropped: _Optional[int] = ..., stale_masked: _Optional[int] = ..., stale_recycled: _Optional[int] = ..., dead_lettered: _Optional[int] = ..., redelivered: _Optional[int] = ..., group_backlog: _Optional[int] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("learner_version", "engines", "max_engine_lag", "swap_in_progress", "store", "lag")
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENGINE_LAG_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    learner_version: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineVersion]
    max_engine_lag: int
    swap_in_progress: bool
    store: StoreStatus
    lag: LagStatus
    def __init__(self, learner_version: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineVersion, _Mapping]]] = ..., max_engine_lag: _Optional[int] = ..., swap_in_progress: _Optional[bool] = ..., store: _Optional[_Union[StoreStatus, _Mapping]] = ..., lag: _Optional[_Union[LagStatus, _Mapping]] = ...) -> None: ...

class LagBucket(_message.Message):
    __slots__ = ("lag", "tokens")
    LAG_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    lag: int
    tokens: int
    def __init__(self, lag: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class LagDistribution(_message.Message):
    __slots__ = ("buckets", "tokens")
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[LagBucket]
    tokens: int
    def __init__(self, buckets: _Optional[_Iterable[_Union[LagBucket, _Mapping]]] = ..., tokens: _Optional[int] = ...) -> None: ...

class EngineLag(_message.Message):
    __slots__ = ("engine_id", "state", "version", "lag")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAG_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    state: str
    version: int
    lag: int
    def __init__(self, engine_id: _Optional[str] = ..., state: _Optional[str] = ..., version: _Optional[int] = ..., lag: _Optional[int] = ...) -> None: ...

class PauseWindow(_message.Message):
    __slots__ = ("swap_id", "version", "mode", "engine_id", "paused_at", "resumed_at")
    SWAP_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PAUSED_AT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_AT_FIELD_NUMBER: _ClassVar[int]
    swap_id: str
    version: int
    mode: str
    engine_id: str
    paused_at: float
    resumed_at: float
    def __init__(self, swap_id: _Optional[str] = ..., version: _Optional[int] = ..., mode: _Optional[str] = ..., engine_id: _Optional[str] = ..., paused_at: _Optional[float] = ..., resumed_at: _Optional[float] = ...) -> None: ...

class GroupLag(_message.Message):
    __slots__ = ("group", "backlog", "pending", "redelivered")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BACKLOG_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_FIELD_NUMBER: _ClassVar[int]
    group: str
    backlog: int
    pending: int
    redelivered: int
    def __init__(self, group: _Optional[str] = ..., backlog: _Optional[int] = ..., pending: _Optional[int] = ..., redelivered: _Optional[int] = ...) -> None: ...

class LagStatus(_message.Message):
    __slots__ = ("replica", "engines", "in_flight", "unconsumed", "delivered", "in_flight_samples", "trajectories_finished", "trajectories_spanning_versions", "max_intra_lag", "tokens_after_switch", "tokens_on_stale_kv", "pause_windows", "tokens_reprefilled", "dropped_at_finish", "masked_at_finish", "recycled_at_finish", "groups", "error")
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    UNCONSUMED_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FINISHED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_SPANNING_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_INTRA_LAG_FIELD_NUMBER: _ClassVar[int]
    TOKENS_AFTER_SWITCH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ON_STALE_KV_FIELD_NUMBER: _ClassVar[int]
    PAUSE_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_REPREFILLED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_AT_FINISH_FIELD_NUMBER: _ClassVar[int]
    MASKED_AT_FINISH_FIELD_NUMBER: _ClassVar[int]
    RECYCLED_AT_FINISH_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    replica: str
    engines: _containers.RepeatedCompositeFieldContainer[EngineLag]
    in_flight: LagDistribution
    unconsumed: LagDistribution
    delivered: LagDistribution
    in_flight_samples: int
    trajectories_finished: int
    trajectories_spanning_versions: int
    max_intra_lag: int
    tokens_after_switch: int
    tokens_on_stale_kv: int
    pause_windows: _containers.RepeatedCompositeFieldContainer[PauseWindow]
    tokens_reprefilled: int
    dropped_at_finish: int
    masked_at_finish: int
    recycled_at_finish: int
    groups: _containers.RepeatedCompositeFieldContainer[GroupLag]
    error: str
    def __init__(self, replica: _Optional[str] = ..., engines: _Optional[_Iterable[_Union[EngineLag, _Mapping]]] = ..., in_flight: _Optional[_Union[LagDistribution, _Mapping]] = ..., unconsumed: _Optional[_Union[LagDistribution, _Mapping]] = ..., delivered: _Optional[_Union[LagDistribution, _Mapping]] = ..., in_flight_samples: _Optional[int] = ..., trajectories_finished: _Optional[int] = ..., trajectories_spanning_versions: _Optional[int] = ..., max_intra_lag: _Optional[int] = ..., tokens_after_switch: _Optional[int] = ..., tokens_on_stale_kv: _Optional[int] = ..., pause_windows: _Optional[_Iterable[_Union[PauseWindow, _Mapping]]] = ..., tokens_reprefilled: _Optional[int] = ..., dropped_at_finish: _Optional[int] = ..., masked_at_finish: _Optional[int] = ..., recycled_at_finish: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[GroupLag, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...

class WeightSource(_message.Message):
    __slots__ = ("kind", "uri", "options")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    uri: str
    options: _containers.ScalarMap[str, str]
    def __init__(self, kind: _Optional[str] = ..., uri: _Optional[str] = ..., options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class AnnounceRequest(_message.Message):
    __slots__ = ("version", "source", "mode", "rolling")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    ROLLING_FIELD_NUMBER: _ClassVar[int]
    version: int
    source: WeightSource
    mode: str
    rolling: bool
    def __init__(self, version: _Optional[int] = ..., source: _Optional[_Union[WeightSource, _Mapping]] = ..., mode: _Optional[str] = ..., rolling: _Optional[bool] = ...) -> None: ...

class AnnounceResponse(_message.Message):
    __slots__ = ("accepted", "version", "message", "pause_seconds")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    version: int
    message: str
    pause_seconds: float
    def __init__(self, accepted: _Optional[bool] = ..., version: _Optional[int] = ..., message: _Optional[str] = ..., pause_seconds: _Optional[float] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VersionEvent(_message.Message):
    __slots__ = ("version", "kind", "engine_id", "at", "message")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    version: int
    kind: str
    engine_id: str
    at: float
    message: str
    def __init__(self, version: _Optional[int] = ..., kind: _Optional[str] = ..., engine_id: _Optional[str] = ..., at: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...
