"""What router tests with fake workers, in this process, share: a worker's token bus
(Decode.Subscribe: an empty batch first, the bus is open, then what the fake worker sends, chunk
by chunk) and the gRPC context a request arrives with."""
from __future__ import annotations

import asyncio

import grpc

from baton.v1 import decode_pb2


class FakeBus:
    def __init__(self):
        self.items: asyncio.Queue = asyncio.Queue()
        self.items.put_nowait(decode_pb2.TokenBatch())

    async def read(self):
        item = await self.items.get()
        if isinstance(item, Exception):
            raise item
        return item

    def send(self, request_id: str, *chunks) -> None:
        """Each chunk in a batch of its own; an exception ends the bus with it (the worker died)."""
        for c in chunks:
            if isinstance(c, Exception):
                self.items.put_nowait(c)
            else:
                c.request_id = request_id
                self.items.put_nowait(decode_pb2.TokenBatch(chunks=[c]))

    def cancel(self):
        self.items.put_nowait(grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(),
                                                   grpc.aio.Metadata(), "cancelled"))


class FakeContext:
    """What RouterService.generate asks of a gRPC context."""

    def time_remaining(self):
        return 30.0

    def peer(self):
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self):
        return ()
