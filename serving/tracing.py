"""OpenTelemetry traces of a request across the router, the prefill worker, the KV transfer and the
decode worker, one trace id end to end: the W3C trace context (`traceparent`) rides the gRPC
metadata of each hop, and comes in on the HTTP API's headers or a gRPC client's metadata.

Off unless `--otlp-traces-endpoint URL` is given (vLLM's flag; spans are exported over OTLP/HTTP
by the maintained SDK, `pip install 'baton[trace]'`). When off, nothing of OpenTelemetry is
imported, `start` returns None and the helpers do nothing: the cost is one `is None` a hop.

Spans: `baton.request` (router, the whole request) with children `admit` (the decode worker's
admission RPC), `prefill` (the Prefill RPC) and `colocated` (a colocated worker's Start); on the
prefill worker `prefill.worker` (queue, compute, push) and under it `kv_transfer` (from the
reply's own timing); on the decode worker `decode` (admission to the request's end there)."""
from __future__ import annotations

import time

CARRIED = ("traceparent", "tracestate")        # the W3C headers a hop carries

_tracer = None


def setup(service: str, endpoint: str | None) -> None:
    """Export this process's spans to `endpoint` (an OTLP/HTTP traces URL), as `service`."""
    if not endpoint:
        return
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise SystemExit("--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter: "
                         "pip install 'baton[trace]'") from None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    use(provider)


def use(provider) -> None:
    """Trace through `provider` (an SDK TracerProvider; tests give one with an in-memory
    exporter), or stop tracing (None)."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer("baton")


def enabled() -> bool:
    return _tracer is not None


def start(name: str, metadata=(), *, parent=None, attributes: dict | None = None, start_time: float | None = None):
    """A span named `name`, child of `parent` (a span) or of the trace context in `metadata`
    (gRPC metadata or HTTP headers as (key, value) pairs; none: a new trace). `start_time`: a
    time.time() in the past. None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import propagate, trace
    if parent is not None:
        ctx = trace.set_span_in_context(parent)
    else:
        ctx = propagate.extract({k.lower(): v for k, v in metadata if k.lower() in CARRIED})
    return _tracer.start_span(name, context=ctx, attributes=attributes,
                              start_time=None if start_time is None else int(start_time * 1e9))


def carry(span) -> dict:
    """The keyword arguments of a gRPC call that carry `span`'s context to the next hop ({} when
    there is no span: the call is made exactly as without tracing)."""
    if span is None:
        return {}
    from opentelemetry import propagate, trace
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return {"metadata": tuple(carrier.items())}


def end(span, error: BaseException | str | None = None, end_time: float | None = None) -> None:
    """End `span` (None: nothing), marked as an error when `error` is given."""
    if span is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end(end_time=None if end_time is None else int(end_time * 1e9))


def child_from_timing(parent, name: str, seconds: float, attributes: dict | None = None) -> None:
    """A finished child span of `parent` for something that took `seconds` and just ended
    (measured elsewhere: the KV transfer, timed by the prefill worker's engine core)."""
    if parent is None or seconds <= 0:
        return
    now = time.time()
    end(start(name, parent=parent, attributes=attributes, start_time=now - seconds), end_time=now)
