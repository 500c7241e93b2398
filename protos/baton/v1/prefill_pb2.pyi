from baton.v1 import router_pb2 as _router_pb2
from baton.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConnectKVRequest(_message.Message):
    __slots__ = ("decode_address", "backend", "timeout_ms")
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    decode_address: str
    backend: str
    timeout_ms: int
    def __init__(self, decode_address: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class ConnectKVResponse(_message.Message):
    __slots__ = ("seconds", "handshaken")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKEN_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    handshaken: bool
    def __init__(self, seconds: _Optional[float] = ..., handshaken: _Optional[bool] = ...) -> None: ...

class Handoff(_message.Message):
    __slots__ = ("decode_address", "transfer_id", "backend", "skip_blocks")
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    decode_address: str
    transfer_id: str
    backend: str
    skip_blocks: int
    def __init__(self, decode_address: _Optional[str] = ..., transfer_id: _Optional[str] = ..., backend: _Optional[str] = ..., skip_blocks: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "handoff", "timeout_ms", "images", "audios")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    AUDIOS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _router_pb2.SamplingParams
    handoff: Handoff
    timeout_ms: int
    images: _containers.RepeatedCompositeFieldContainer[_router_pb2.Image]
    audios: _containers.RepeatedCompositeFieldContainer[_router_pb2.Audio]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_router_pb2.SamplingParams, _Mapping]] = ..., handoff: _Optional[_Union[Handoff, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., images: _Optional[_Iterable[_Union[_router_pb2.Image, _Mapping]]] = ..., audios: _Optional[_Iterable[_Union[_router_pb2.Audio, _Mapping]]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "cached_prompt_tokens", "prefill_seconds", "transfer_seconds", "transfer_bytes")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    cached_prompt_tokens: int
    prefill_seconds: float
    transfer_seconds: float
    transfer_bytes: int
    def __init__(self, first_token: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., transfer_bytes: _Optional[int] = ...) -> None: ...
