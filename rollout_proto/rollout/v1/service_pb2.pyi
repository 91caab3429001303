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
STALE_POLICY_UNSPECIFIED: StalePolicy
STALE_POLICY_DROP: StalePolicy
STALE_POLICY_MASK: StalePolicy
STALE_POLICY_RECYCLE: StalePolicy

class OpenStream(_message.Message):
    __slots__ = ("group", "consumer", "learner_version", "max_lag", "stale_policy")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    STALE_POLICY_FIELD_NUMBER: _ClassVar[int]
    group: str
    consumer: str
    learner_version: int
    max_lag: int
    stale_policy: StalePolicy
    def __init__(self, group: _Optional[str] = ..., consumer: _Optional[str] = ..., learner_version: _Optional[int] = ..., max_lag: _Optional[int] = ..., stale_policy: _Optional[_Union[StalePolicy, str]] = ...) -> None: ...

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
    __slots__ = ("entry_id", "delivery_count", "masked", "trajectory")
    ENTRY_ID_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    entry_id: str
    delivery_count: int
    masked: bool
    trajectory: _trajectory_pb2.Trajectory
    def __init__(self, entry_id: _Optional[str] = ..., delivery_count: _Optional[int] = ..., masked: _Optional[bool] = ..., trajectory: _Optional[_Union[_trajectory_pb2.Trajectory, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("learner_version", "engines", "max_engine_lag", "swap_in_progress", "store")
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENGINE_LAG_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    learner_version: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineVersion]
    max_engine_lag: int
    swap_in_progress: bool
    store: StoreStatus
    def __init__(self, learner_version: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineVersion, _Mapping]]] = ..., max_engine_lag: _Optional[int] = ..., swap_in_progress: _Optional[bool] = ..., store: _Optional[_Union[StoreStatus, _Mapping]] = ...) -> None: ...

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
