from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("model", "architecture", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size", "tp_rank", "backends", "kv_scales")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    tp_rank: int
    backends: _containers.RepeatedScalarFieldContainer[str]
    kv_scales: str
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., backends: _Optional[_Iterable[str]] = ..., kv_scales: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("layout", "nonce", "unix_ms", "proof")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    nonce: bytes
    unix_ms: int
    proof: bytes
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., nonce: _Optional[bytes] = ..., unix_ms: _Optional[int] = ..., proof: _Optional[bytes] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("layout", "max_chunk_bytes", "max_window_bytes", "session", "proof")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_WINDOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    max_chunk_bytes: int
    max_window_bytes: int
    session: bytes
    proof: bytes
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., max_chunk_bytes: _Optional[int] = ..., max_window_bytes: _Optional[int] = ..., session: _Optional[bytes] = ..., proof: _Optional[bytes] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("transfer_id", "index", "offset", "data", "crc32", "open", "done")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    index: int
    offset: int
    data: bytes
    crc32: int
    open: PushOpen
    done: PushDone
    def __init__(self, transfer_id: _Optional[str] = ..., index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., open: _Optional[_Union[PushOpen, _Mapping]] = ..., done: _Optional[_Union[PushDone, _Mapping]] = ...) -> None: ...

class PushOpen(_message.Message):
    __slots__ = ("total_bytes", "chunk_bytes", "window_bytes")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    chunk_bytes: int
    window_bytes: int
    def __init__(self, total_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., window_bytes: _Optional[int] = ...) -> None: ...

class PushDone(_message.Message):
    __slots__ = ("first_token", "num_tokens", "num_chunks", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_tokens: int
    num_chunks: int
    extra: _containers.ScalarMap[str, str]
    def __init__(self, first_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class KVAck(_message.Message):
    __slots__ = ("kind", "index", "credit", "reason")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KVAck.Kind]
        KIND_CREDIT: _ClassVar[KVAck.Kind]
        KIND_ACK: _ClassVar[KVAck.Kind]
        KIND_NACK: _ClassVar[KVAck.Kind]
        KIND_DONE: _ClassVar[KVAck.Kind]
        KIND_REFUSED: _ClassVar[KVAck.Kind]
    KIND_UNSPECIFIED: KVAck.Kind
    KIND_CREDIT: KVAck.Kind
    KIND_ACK: KVAck.Kind
    KIND_NACK: KVAck.Kind
    KIND_DONE: KVAck.Kind
    KIND_REFUSED: KVAck.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CREDIT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: KVAck.Kind
    index: int
    credit: int
    reason: str
    def __init__(self, kind: _Optional[_Union[KVAck.Kind, str]] = ..., index: _Optional[int] = ..., credit: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("pair_id", "collective")
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    collective: str
    def __init__(self, pair_id: _Optional[str] = ..., collective: _Optional[str] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("store_host", "store_port", "collective")
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    store_host: str
    store_port: int
    collective: str
    def __init__(self, store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., collective: _Optional[str] = ...) -> None: ...

class DirectMessage(_message.Message):
    __slots__ = ("hello", "open", "piece", "finish", "abandon", "batch")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    ABANDON_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    hello: DirectHello
    open: DirectOpen
    piece: DirectPiece
    finish: DirectFinish
    abandon: DirectAbandon
    batch: DirectBatch
    def __init__(self, hello: _Optional[_Union[DirectHello, _Mapping]] = ..., open: _Optional[_Union[DirectOpen, _Mapping]] = ..., piece: _Optional[_Union[DirectPiece, _Mapping]] = ..., finish: _Optional[_Union[DirectFinish, _Mapping]] = ..., abandon: _Optional[_Union[DirectAbandon, _Mapping]] = ..., batch: _Optional[_Union[DirectBatch, _Mapping]] = ...) -> None: ...

class DirectBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[DirectMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[DirectMessage, _Mapping]]] = ...) -> None: ...

class DirectHello(_message.Message):
    __slots__ = ("pair_id",)
    PAIR_ID_FIELD_NUMBER: _ClassVar[int]
    pair_id: str
    def __init__(self, pair_id: _Optional[str] = ...) -> None: ...

class DirectOpen(_message.Message):
    __slots__ = ("transfer_id", "total_bytes", "num_tokens")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    total_bytes: int
    num_tokens: int
    def __init__(self, transfer_id: _Optional[str] = ..., total_bytes: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class DirectPiece(_message.Message):
    __slots__ = ("transfer_id", "first_block", "num_blocks", "first_token", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    first_block: int
    num_blocks: int
    first_token: int
    extra: _containers.ScalarMap[str, str]
    def __init__(self, transfer_id: _Optional[str] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., first_token: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DirectFinish(_message.Message):
    __slots__ = ("transfer_id", "first_token", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    first_token: int
    extra: _containers.ScalarMap[str, str]
    def __init__(self, transfer_id: _Optional[str] = ..., first_token: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class DirectAbandon(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DirectAck(_message.Message):
    __slots__ = ("kind", "transfer_id", "reason", "code", "batch")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[DirectAck.Kind]
        KIND_READY: _ClassVar[DirectAck.Kind]
        KIND_DONE: _ClassVar[DirectAck.Kind]
        KIND_REFUSED: _ClassVar[DirectAck.Kind]
    KIND_UNSPECIFIED: DirectAck.Kind
    KIND_READY: DirectAck.Kind
    KIND_DONE: DirectAck.Kind
    KIND_REFUSED: DirectAck.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    kind: DirectAck.Kind
    transfer_id: str
    reason: str
    code: int
    batch: _containers.RepeatedCompositeFieldContainer[DirectAck]
    def __init__(self, kind: _Optional[_Union[DirectAck.Kind, str]] = ..., transfer_id: _Optional[str] = ..., reason: _Optional[str] = ..., code: _Optional[int] = ..., batch: _Optional[_Iterable[_Union[DirectAck, _Mapping]]] = ...) -> None: ...
