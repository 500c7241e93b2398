"""Traces (serving/tracing.py): one PD request, router + prefill + decode serving on loopback in
this process (real gRPC servers, the in-memory KV backend), is one trace from the client's span
down: the router's request span, the prefill worker's span with the KV transfer under it, and the
decode worker's span, read back through the OpenTelemetry SDK's in-memory exporter. Off (the
default), no span is made and the workers' calls carry no trace metadata."""
from __future__ import annotations

import asyncio

import pytest
from fake_worker import FakeContext
from test_kv_handoff import workers

from baton.router.config import RouterConfig
from baton.router.registry import Registry
from baton.router.server import RouterService
from baton.serving import tracing
from baton.v1 import router_pb2

sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk is in the test extra")
from opentelemetry import propagate, trace  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402


class TracedContext(FakeContext):
    """A gRPC context whose client sent a W3C trace context (its own span's)."""

    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


def serve_one(context) -> list[int]:
    async def scenario():
        async with workers() as (prefill, decode):
            reg = Registry([prefill.server.address], [decode.server.address], [], "tiny-llama")
            await reg.start()
            try:
                info = router_pb2.ModelInfo(name="tiny-llama", max_model_len=2048, vocab_size=32_000)
                svc = RouterService(reg, None, info, RouterConfig(prefill=["p"], decode=["d"]))
                req = router_pb2.GenerateRequest(tokens=router_pb2.TokenIds(ids=list(range(1000, 1040))),
                                                 sampling=router_pb2.SamplingParams(temperature=0, max_tokens=4,
                                                                                    ignore_eos=True))
                tokens = [t async for r in svc.generate(req, context) for t in r.token_ids]
                for _ in range(100):                 # the decode worker's span ends as its stream is taken
                    if not decode.streams:
                        break
                    await asyncio.sleep(0.05)
                return tokens
            finally:
                await reg.stop()
    return asyncio.run(scenario())


def test_one_pd_request_is_one_trace_across_router_prefill_transfer_and_decode():
    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = provider.get_tracer("client").start_span("client call")
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(client))
    tracing.use(provider)
    try:
        tokens = serve_one(TracedContext(tuple(carrier.items())))
    finally:
        tracing.use(None)
        client.end()
    assert len(tokens) == 4
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"client call", "baton.request", "prefill.worker", "kv_transfer", "decode"} <= set(spans), sorted(spans)
    assert {s.context.trace_id for s in spans.values()} == {client.get_span_context().trace_id}
    request = spans["baton.request"]
    assert request.parent.span_id == client.get_span_context().span_id
    assert spans["prefill.worker"].parent.span_id == request.context.span_id
    assert spans["decode"].parent.span_id == request.context.span_id
    assert spans["kv_transfer"].parent.span_id == spans["prefill.worker"].context.span_id
    assert spans["kv_transfer"].attributes["baton.kv_bytes"] > 0
    assert all(s.status.is_ok for s in spans.values())
    for name in ("prefill.worker", "kv_transfer", "decode"):      # inside the request, in time (decode's span
        # ends when the worker's stream is taken, a moment after the router's: up to 1 s on a loaded box)
        assert request.start_time <= spans[name].start_time <= spans[name].end_time <= request.end_time + 10**9


def test_tracing_off_makes_no_span_and_adds_no_metadata():
    assert not tracing.enabled()
    assert tracing.start("x", (("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),)) is None
    assert tracing.carry(None) == {}
    tracing.end(None, "anything")                                  # nothing to end: no error
