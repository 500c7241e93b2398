from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class AdminSwitchRoleRequest(_message.Message):
    __slots__ = ("worker", "role", "timeout_ms")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    role: str
    timeout_ms: int
    def __init__(self, worker: _Optional[str] = ..., role: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class AdminSwitchRoleResponse(_message.Message):
    __slots__ = ("worker", "from_role", "to_role", "seconds", "streams_moved")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    FROM_ROLE_FIELD_NUMBER: _ClassVar[int]
    TO_ROLE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_MOVED_FIELD_NUMBER: _ClassVar[int]
    worker: str
    from_role: str
    to_role: str
    seconds: float
    streams_moved: int
    def __init__(self, worker: _Optional[str] = ..., from_role: _Optional[str] = ..., to_role: _Optional[str] = ..., seconds: _Optional[float] = ..., streams_moved: _Optional[int] = ...) -> None: ...
