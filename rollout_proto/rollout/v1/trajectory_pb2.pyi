from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Array(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("start", "end", "policy_version", "engine_id", "began", "ended", "started_at", "ended_at")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BEGAN_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    policy_version: int
    engine_id: str
    began: str
    ended: str
    started_at: float
    ended_at: float
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., policy_version: _Optional[int] = ..., engine_id: _Optional[str] = ..., began: _Optional[str] = ..., ended: _Optional[str] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ...) -> None: ...

class FinishReason(_message.Message):
    __slots__ = ("type", "matched_token", "matched_text", "length", "message")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TEXT_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    type: str
    matched_token: int
    matched_text: str
    length: int
    message: str
    def __init__(self, type: _Optional[str] = ..., matched_token: _Optional[int] = ..., matched_text: _Optional[str] = ..., length: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class RoutedExperts(_message.Message):
    __slots__ = ("data", "num_experts", "start")
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    data: Array
    num_experts: int
    start: int
    def __init__(self, data: _Optional[_Union[Array, _Mapping]] = ..., num_experts: _Optional[int] = ..., start: _Optional[int] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "group_id", "sample_index", "prompt_token_ids", "token_ids", "logprobs", "entropy", "entropy_kind", "entropy_error_bound", "policy_version", "kv_version", "old_logprobs", "routed_experts", "finish_reason", "segments", "metadata", "reward", "created_at", "finished_at", "loss_mask", "turns")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_KIND_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_ERROR_BOUND_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_VERSION_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    group_id: str
    sample_index: int
    prompt_token_ids: Array
    token_ids: Array
    logprobs: Array
    entropy: Array
    entropy_kind: str
    entropy_error_bound: float
    policy_version: Array
    kv_version: Array
    old_logprobs: Array
    routed_experts: RoutedExperts
    finish_reason: FinishReason
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    metadata: _containers.ScalarMap[str, str]
    reward: float
    created_at: float
    finished_at: float
    loss_mask: Array
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    def __init__(self, trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Union[Array, _Mapping]] = ..., token_ids: _Optional[_Union[Array, _Mapping]] = ..., logprobs: _Optional[_Union[Array, _Mapping]] = ..., entropy: _Optional[_Union[Array, _Mapping]] = ..., entropy_kind: _Optional[str] = ..., entropy_error_bound: _Optional[float] = ..., policy_version: _Optional[_Union[Array, _Mapping]] = ..., kv_version: _Optional[_Union[Array, _Mapping]] = ..., old_logprobs: _Optional[_Union[Array, _Mapping]] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., reward: _Optional[float] = ..., created_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., loss_mask: _Optional[_Union[Array, _Mapping]] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("start", "end", "kind", "index")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    kind: str
    index: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., kind: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...
