from baton.v1 import router_pb2 as _router_pb2
from baton.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("found", "paused", "reason", "output_token_ids", "num_blocks")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    found: bool
    paused: bool
    reason: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_blocks: int
    def __init__(self, found: _Optional[bool] = ..., paused: _Optional[bool] = ..., reason: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("request_id", "kv_address", "transfer_id", "backend", "timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_address: str
    transfer_id: str
    backend: str
    timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., kv_address: _Optional[str] = ..., transfer_id: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class ExportResponse(_message.Message):
    __slots__ = ("transfer_bytes", "transfer_seconds")
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    transfer_bytes: int
    transfer_seconds: float
    def __init__(self, transfer_bytes: _Optional[int] = ..., transfer_seconds: _Optional[float] = ...) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("role", "timeout_ms")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    role: str
    timeout_ms: int
    def __init__(self, role: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class SwitchRoleResponse(_message.Message):
    __slots__ = ("from_role", "to_role", "seconds", "streams_moved")
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_MOVED_FIELD_NUMBER: _ClassVar[int]
    from_role: str
    to_role: str
    seconds: float
    streams_moved: int
    def __init__(self, from_role: _Optional[str] = ..., to_role: _Optional[str] = ..., seconds: _Optional[float] = ..., streams_moved: _Optional[int] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "timeout_ms", "backend", "subscriber", "stream_timeout_ms", "reuse_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    STREAM_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    REUSE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _router_pb2.SamplingParams
    timeout_ms: int
    backend: str
    subscriber: str
    stream_timeout_ms: int
    reuse_prefix: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_router_pb2.SamplingParams, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., backend: _Optional[str] = ..., subscriber: _Optional[str] = ..., stream_timeout_ms: _Optional[int] = ..., reuse_prefix: _Optional[bool] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("transfer_id", "num_blocks", "kv_address", "backend", "skip_blocks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    num_blocks: int
    kv_address: str
    backend: str
    skip_blocks: int
    def __init__(self, transfer_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., kv_address: _Optional[str] = ..., backend: _Optional[str] = ..., skip_blocks: _Optional[int] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("request_id", "timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "timeout_ms", "images", "subscriber", "audios")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    AUDIOS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _router_pb2.SamplingParams
    timeout_ms: int
    images: _containers.RepeatedCompositeFieldContainer[_router_pb2.Image]
    subscriber: str
    audios: _containers.RepeatedCompositeFieldContainer[_router_pb2.Audio]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_router_pb2.SamplingParams, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_router_pb2.Image, _Mapping]]] = ..., subscriber: _Optional[str] = ..., audios: _Optional[_Iterable[_Union[_router_pb2.Audio, _Mapping]]] = ...) -> None: ...

class StartResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TokenChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TokenChunk, _Mapping]]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "handover_seconds", "request_id", "error_code", "error_message", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _router_pb2.FinishReason
    usage: _router_pb2.Usage
    handover_seconds: float
    request_id: str
    error_code: int
    error_message: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_router_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_router_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_router_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_router_pb2.Usage, _Mapping]] = ..., handover_seconds: _Optional[float] = ..., request_id: _Optional[str] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_router_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_router_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
