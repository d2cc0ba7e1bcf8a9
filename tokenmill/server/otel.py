"""--otlp-traces-endpoint: one OpenTelemetry span per engine request, exported over OTLP/HTTP.

A span runs from the request's arrival to its end, with each event of its timeline (timeline.py)
as a span event at its time, and its token counts and latencies as attributes under the
`gen_ai.` names vLLM uses. A W3C `traceparent` header on the HTTP request makes its spans children
of the caller's trace. Spans are built on the engine thread when a request ends and handed to the
SDK's batch processor, which exports them from a thread of its own: the engine never waits on
the collector.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tokenmill.outputs import RequestOutput, StepStats


def otlp_exporter(endpoint: str) -> SpanExporter:
    """The OTLP/HTTP exporter for a collector's URL (`http://host:4318`, or its `/v1/traces` path)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    url = endpoint.rstrip("/")
    return OTLPSpanExporter(endpoint=url if url.endswith("/v1/traces") else url + "/v1/traces")


class RequestSpans:
    def __init__(self, exporter: SpanExporter, service_name: str = "tokenmill") -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tokenmill")
        self._parents: dict[str, Context] = {}       # request id -> the caller's trace context
        self._epoch_ns = time.time_ns() - time.monotonic_ns()  # monotonic ns -> Unix epoch ns

    def start(self, request_ids: list[str], headers: Mapping[str, str]) -> None:
        """Before the requests run: their parent from the HTTP request's `traceparent`, if any."""
        parent = TraceContextTextMapPropagator().extract(headers)
        for rid in request_ids:
            self._parents[rid] = parent

    def on_step(self, stats: StepStats | None, outputs: list[RequestOutput]) -> None:
        """On the engine thread, after each step (and abort): a span for each request that ended."""
        for out in outputs:
            if out.finished and out.timeline is not None:
                self._export(out)

    def shutdown(self) -> None:
        """Export what is pending, then stop the exporter."""
        self.provider.shutdown()

    def _ns(self, t: float) -> int:
        return self._epoch_ns + int(t * 1e9)

    def _export(self, out: RequestOutput) -> None:
        timeline, completion = out.timeline, out.outputs[0]
        events = timeline.events
        span = self.tracer.start_span("llm_request", context=self._parents.pop(out.request_id, None),
                                      kind=SpanKind.SERVER, start_time=self._ns(events[0].time))
        span.set_attributes({"gen_ai.request.id": out.request_id,
                             "gen_ai.usage.prompt_tokens": len(out.prompt_token_ids),
                             "gen_ai.usage.completion_tokens": len(completion.token_ids),
                             "gen_ai.response.finish_reasons": [completion.finish_reason or "unknown"]})
        for name, value in (("gen_ai.latency.time_in_queue", timeline.queue_time),
                            ("gen_ai.latency.time_to_first_token", timeline.ttft),
                            ("gen_ai.latency.time_in_model_prefill", timeline.prefill_time),
                            ("gen_ai.latency.time_in_model_decode", timeline.decode_time),
                            ("gen_ai.latency.e2e", timeline.e2e)):
            if value is not None:
                span.set_attribute(name, value)
        for e in events[1:]:
            span.add_event(e.kind, attributes=dict(e.data), timestamp=self._ns(e.time))
        if completion.finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR, out.error or "the request failed"))
        end = timeline.time_of("finished")
        span.end(end_time=self._ns(end if end is not None else events[-1].time))
