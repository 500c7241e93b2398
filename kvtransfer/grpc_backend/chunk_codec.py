"""Data chunks of the Push stream in protobuf wire format, without protobuf's extra copies.

Building a KVChunk and serializing it copies a chunk's data twice; parsing one and reading
`.data` copies it twice again. These few lines encode a data chunk with one copy and decode it
as a view of the received bytes. The bytes on the wire are exactly KVChunk's (the tests check
both directions against protobuf); anything but a plain data chunk is left to protobuf.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

from baton.v1 import kvtransfer_pb2

_MASK32, _MASK64 = (1 << 32) - 1, (1 << 64) - 1
_LEN, _VARINT = 2, 0
# KVChunk's data fields: number -> wire type (transfer_id, index, offset, data, crc32)
_DATA_FIELDS = {1: _LEN, 2: _VARINT, 3: _VARINT, 4: _LEN, 5: _VARINT}


@dataclass(slots=True)
class DataChunk:
    """A KVChunk with no control field, its `data` a view into the received message."""

    transfer_id: str
    index: int
    offset: int
    data: memoryview
    crc32: int

    def WhichOneof(self, name: str) -> None:          # noqa: N802 - the protobuf message's name
        return None


def varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def transfer_id_field(transfer_id: str) -> bytes:
    """Field 1 of KVChunk, encoded once per transfer."""
    tid = transfer_id.encode()
    return varint(1 << 3 | _LEN) + varint(len(tid)) + tid


def encode_chunk(tid_field: bytes, index: int, offset: int, data: memoryview) -> bytes:
    """KVChunk{transfer_id, index, offset, data, crc32=zlib.crc32(data)}, serialized."""
    return b"".join((tid_field, b"\x10", varint(index), b"\x18", varint(offset), b"\x22", varint(len(data)),
                     data, b"\x28", varint(zlib.crc32(data))))


def decode_chunk(raw: bytes) -> DataChunk | kvtransfer_pb2.KVChunk:
    """KVChunk.FromString(raw), except that a plain data chunk becomes a DataChunk viewing `raw`."""
    view = memoryview(raw)
    values: dict[int, object] = {1: view[:0], 2: 0, 3: 0, 4: view[:0], 5: 0}
    pos, end = 0, len(raw)
    try:
        while pos < end:
            key, pos = _read_varint(raw, pos)
            field, wire = key >> 3, key & 7
            if _DATA_FIELDS.get(field) != wire:
                raise ValueError("not a plain data chunk")
            value, pos = _read_varint(raw, pos)
            if wire == _LEN:
                if pos + value > end:
                    raise ValueError("truncated")
                value, pos = view[pos:pos + value], pos + value
            values[field] = value                     # a repeated field: the last one wins, as in protobuf
        transfer_id = bytes(values[1]).decode()
    except (ValueError, IndexError):                  # UnicodeDecodeError is a ValueError
        return kvtransfer_pb2.KVChunk.FromString(raw)  # protobuf's own verdict, errors included
    return DataChunk(transfer_id, values[2] & _MASK32, values[3] & _MASK64, values[4], values[5] & _MASK32)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        result |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            break
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")
    if result > _MASK64:
        raise ValueError("varint wider than 64 bits")
    return result, pos
