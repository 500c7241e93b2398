"""A baton.v1.Router of known capacity, for the goodput search's tests: it serves at most
`capacity` requests a second on average and refuses the rest with RESOURCE_EXHAUSTED.

Its credit grows by `capacity` a second from the moment a burst of load begins (after
`idle_reset_s` without a request) and each accepted request spends one; with no cap on the
credit, the accepted count over a long window is capacity x its length whatever the arrivals'
bunching, so above capacity the served share is capacity / rate and its goodput (>= 90 % served)
is exactly capacity / 0.9. Accepted requests stream `tokens` tokens, `tpot_s` apart.
"""
from __future__ import annotations

import asyncio
import threading

import grpc

from baton.v1 import router_pb2, router_pb2_grpc

VOCAB = 1000


class CreditRouter(router_pb2_grpc.RouterServicer):
    def __init__(self, capacity: float, tokens: int = 2, tpot_s: float = 0.002, idle_reset_s: float = 0.2,
                 initial_credit: float = 2.0):
        self.capacity, self.tokens, self.tpot_s = capacity, tokens, tpot_s
        self.idle_reset_s, self.initial_credit = idle_reset_s, initial_credit
        self.start: float | None = None
        self.last = 0.0
        self.spent = self.accepted = self.refused = 0

    def _admit(self, now: float) -> bool:
        if self.start is None or now - self.last > self.idle_reset_s:   # a new burst of load: fresh credit
            self.start, self.spent = now, 0
        self.last = now
        if self.initial_credit + self.capacity * (now - self.start) - self.spent < 1:
            return False
        self.spent += 1
        return True

    async def Generate(self, request, context):
        if not self._admit(asyncio.get_running_loop().time()):
            self.refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "over capacity: retry later")
        self.accepted += 1
        n = min(self.tokens, request.sampling.max_tokens or self.tokens)
        for i in range(n):
            last = i == n - 1
            yield router_pb2.GenerateResponse(
                token_ids=[7], finish_reason=router_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=router_pb2.Usage(prompt_tokens=len(request.tokens.ids), completion_tokens=n) if last else None)
            if not last:
                await asyncio.sleep(self.tpot_s)

    async def GetModelInfo(self, request, context):
        return router_pb2.ModelInfo(name="credit-router", architecture="fake", max_model_len=4096, vocab_size=VOCAB)

    async def GetServerInfo(self, request, context):
        return router_pb2.ServerInfo(workers=[router_pb2.WorkerInfo(address="fake", role="colocated", healthy=True)])


class Served:
    """The fake on its own event loop in a thread, at `address`, until `stop()`."""

    def __init__(self, servicer: CreditRouter):
        self.servicer = servicer
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.address = ""

    def __enter__(self) -> Served:
        self.thread.start()
        if not self.ready.wait(10):
            raise TimeoutError("the fake router did not start within 10 s")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stopping.set)
        self.thread.join(10)

    def _main(self) -> None:
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        router_pb2_grpc.add_RouterServicer_to_server(self.servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.address = f"127.0.0.1:{port}"
        self._stopping = asyncio.Event()
        self.ready.set()
        await self._stopping.wait()
        await server.stop(0.5)
