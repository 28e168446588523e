"""`tandem.tracing`: off by default at no cost, the engines' OTEL_* environment, trace context in and out."""

from __future__ import annotations

from tandem import tracing
from tandem.tracing_config import TracingConfig, engine_env


def test_off_by_default_installs_nothing_and_spans_are_a_shared_null_context():
    assert not TracingConfig().enabled
    assert tracing.setup(TracingConfig(), "tandem-test") is False
    assert tracing.ENABLED is False
    assert tracing.server_interceptor() is None
    first, second = tracing.span("a"), tracing.span("b", None, {"k": 1})
    assert first is second  # no allocation per span when off
    with first as current:
        assert current is None
    assert tracing.traceparent() == ""
    assert engine_env(TracingConfig()) == {}


def test_engines_get_the_collector_in_the_standard_environment_and_simengine_reads_it_back():
    config = TracingConfig(otlp_endpoint="otel.monitoring:4317", sample_ratio=0.25)
    env = engine_env(config)
    assert env[tracing.OTLP_TRACES_ENDPOINT] == "http://otel.monitoring:4317"
    assert (
        env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
    )
    collector = tracing.from_env(env)
    assert collector is not None and collector.endpoint_url == config.endpoint_url
    assert collector.sample_ratio == 0.25 and not collector.otlp_tls
    assert tracing.from_env({}) is None


def test_trace_context_from_headers_and_metadata():
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert tracing.context_of({}) is None and tracing.metadata_context(()) is None
    for context in (
        tracing.context_of({"traceparent": parent}),
        tracing.metadata_context((("x-other", "1"), ("traceparent", parent))),
    ):
        from opentelemetry import trace

        span_context = trace.get_current_span(context).get_span_context()
        assert f"{span_context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
        assert span_context.is_remote and span_context.trace_flags.sampled


def test_the_ingress_sampling_decides_an_unsampled_or_parentless_step_records_nothing(monkeypatch):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    # This process's tracer, without installing it globally (other tests run untraced).
    monkeypatch.setattr(tracing, "ENABLED", True)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "_current_span", trace.get_current_span)

    unsampled = tracing.context_of({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"})
    assert unsampled is tracing.UNSAMPLED
    with tracing.span("under an unsampled ingress", unsampled) as current:
        assert current is None
    with tracing.span("no parent, not a root") as current:
        assert current is None and tracing.traceparent() == ""
    parent = tracing.context_of({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    with tracing.span("route", parent) as route:
        assert route is not None
        with tracing.span("child") as child:
            assert child is not None
            passed_on = tracing.traceparent()
    assert passed_on.startswith("00-0af7651916cd43dd8448eb211c80319c-") and passed_on.endswith("-01")
    names = {s.name: s for s in exported.get_finished_spans()}
    assert set(names) == {"route", "child"}
    assert names["child"].parent.span_id == names["route"].context.span_id
    assert f"{names['route'].parent.span_id:016x}" == "b7ad6b7169203331"
