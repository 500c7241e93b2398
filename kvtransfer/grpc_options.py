"""gRPC options both ends of the KV channel use, so their limits and keepalives agree.

Message limits sit a little above the largest chunk: a chunk's data plus its few header
fields always fits, and nothing bigger is accepted. Clients ping every 20 s (also when idle,
so a vanished decode worker is noticed); servers allow pings every 10 s, so they never
answer those pings with GOAWAY "too_many_pings".
"""
from __future__ import annotations

DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_WINDOW_BYTES = 16 << 20
MAX_CHUNK_BYTES = 16 << 20
MESSAGE_HEADROOM_BYTES = 64 << 10            # transfer id, index, offset, crc and framing

KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_PING_INTERVAL_MS = 10_000                # what the server tolerates; below KEEPALIVE_TIME_MS

Options = list[tuple[str, int]]


def max_message_bytes(max_chunk_bytes: int = MAX_CHUNK_BYTES) -> int:
    return max_chunk_bytes + MESSAGE_HEADROOM_BYTES


def _common(max_chunk_bytes: int) -> Options:
    return [
        ("grpc.max_send_message_length", max_message_bytes(max_chunk_bytes)),
        ("grpc.max_receive_message_length", max_message_bytes(max_chunk_bytes)),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(max_chunk_bytes: int = MAX_CHUNK_BYTES) -> Options:
    return [
        ("grpc.so_reuseport", 0),            # otherwise a second server on a taken port silently "succeeds"
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        *_common(max_chunk_bytes),
    ]


def channel_options(max_chunk_bytes: int = MAX_CHUNK_BYTES) -> Options:
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.enable_retries", 0),          # a failed push is the caller's decision, never replayed
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        *_common(max_chunk_bytes),
    ]
