from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("role", "model", "running", "waiting", "kv_blocks_total", "kv_blocks_free", "block_size", "max_model_len", "kv_backends", "device", "draining", "requests_served", "kv_address", "step_p99_ms", "stalled_seconds", "busy_seconds", "busy_budget_seconds", "busy_tokens", "seconds_per_token", "switching_to", "switchable", "kv_skip_blocks")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_P99_MS_FIELD_NUMBER: _ClassVar[int]
    STALLED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUSY_BUDGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUSY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SWITCHING_TO_FIELD_NUMBER: _ClassVar[int]
    SWITCHABLE_FIELD_NUMBER: _ClassVar[int]
    KV_SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    max_model_len: int
    kv_backends: _containers.RepeatedScalarFieldContainer[str]
    device: str
    draining: bool
    requests_served: int
    kv_address: str
    step_p99_ms: float
    stalled_seconds: float
    busy_seconds: float
    busy_budget_seconds: float
    busy_tokens: int
    seconds_per_token: float
    switching_to: str
    switchable: bool
    kv_skip_blocks: bool
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., kv_backends: _Optional[_Iterable[str]] = ..., device: _Optional[str] = ..., draining: _Optional[bool] = ..., requests_served: _Optional[int] = ..., kv_address: _Optional[str] = ..., step_p99_ms: _Optional[float] = ..., stalled_seconds: _Optional[float] = ..., busy_seconds: _Optional[float] = ..., busy_budget_seconds: _Optional[float] = ..., busy_tokens: _Optional[int] = ..., seconds_per_token: _Optional[float] = ..., switching_to: _Optional[str] = ..., switchable: _Optional[bool] = ..., kv_skip_blocks: _Optional[bool] = ...) -> None: ...

class GetMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerMetrics(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: bytes
    def __init__(self, text: _Optional[bytes] = ...) -> None: ...

class GetKVEventsRequest(_message.Message):
    __slots__ = ("epoch", "since")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    since: int
    def __init__(self, epoch: _Optional[str] = ..., since: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("block_hash", "removed")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    removed: bool
    def __init__(self, block_hash: _Optional[int] = ..., removed: _Optional[bool] = ...) -> None: ...

class KVEvents(_message.Message):
    __slots__ = ("epoch", "seq", "reset", "events", "block_size")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    reset: bool
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    block_size: int
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., block_size: _Optional[int] = ...) -> None: ...

class WorkerAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class WorkerAbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
