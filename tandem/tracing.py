"""Distributed tracing (OpenTelemetry), off by default and then free.

The mesh file's `tracing` section (`TracingConfig`) names an OTLP/gRPC collector; `setup` installs an SDK tracer
provider exporting to it for this process, with its `service.name`. Nothing is installed when the section names no
collector: `ENABLED` stays False and every instrumented path in the components tests that one module attribute
before doing anything else, so a mesh without tracing pays one attribute read per request (docs/operations.md,
"Tracing").

Trace context travels as W3C `traceparent`: Envoy's tracer sends it to the coordinator in the ext_authz/ext_proc
call's metadata and to the engine in the request's headers; the coordinator passes it to the conductor in each
`MatchRequest` and to the prefill engine of a P/D handoff; engines launched by a node agent get the collector in
the standard `OTEL_*` environment (`engine_env`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.netaddr import Address

log = logging.getLogger(__name__)

#: True once `setup` installed an exporting tracer provider in this process; read on every request path.
ENABLED = False
_tracer: Any = None

TRACEPARENT = "traceparent"
#: The standard variable naming the collector of an engine process (`engine_env`).
OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


class TracingConfig(BaseModel):
    """The mesh file's `tracing` section: where every component, and the engines the agents launch, send spans."""

    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: Address | None = None
    """`host:port` of an OTLP/gRPC collector (plain gRPC unless `otlp_tls`). Unset: tracing is off, at no cost."""
    sample_ratio: float = Field(default=0.01, ge=0.0, le=1.0)
    """Share of new traces recorded (Envoy decides at the ingress; a request whose `traceparent` says sampled is
    recorded whatever the ratio: the client asked for it). 0 records only those."""
    otlp_tls: bool = False
    """Send to the collector over TLS, trusting `ca_file`."""
    ca_file: str | None = None
    """PEM bundle of the CA that signed the collector's certificate; required with `otlp_tls`."""

    @model_validator(mode="after")
    def _tls_needs_ca(self) -> TracingConfig:
        if self.otlp_tls and not self.ca_file:
            raise ValueError("ca_file: required with otlp_tls: true (the CA of the collector's certificate)")
        if self.ca_file and not self.otlp_tls:
            raise ValueError("ca_file: only used with otlp_tls: true")
        return self

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None

    @property
    def endpoint_url(self) -> str:
        """The collector as the OTLP exporters' `endpoint` (`http://` or `https://host:port`)."""
        scheme = "https" if self.otlp_tls else "http"
        return f"{scheme}://{self.otlp_endpoint}"


def setup(config: TracingConfig | None, service_name: str, *, batch: bool = True) -> bool:
    """Installs this process's tracer provider (`service.name` = `service_name`) exporting to the collector;
    returns whether tracing is on. Does nothing when `config` names no collector."""
    global ENABLED, _tracer, _current_span
    if config is None or not config.enabled:
        return False
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    credentials = None
    if config.otlp_tls:
        import grpc

        assert config.ca_file is not None
        with open(config.ca_file, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    # A 2 s bound per export (retries included): an unreachable collector drops spans, never holds a flush or an
    # exit for long.
    exporter = OTLPSpanExporter(
        endpoint=config.endpoint_url, insecure=not config.otlp_tls, credentials=credentials, timeout=2
    )
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        shutdown_on_exit=False,  # `shutdown` flushes with a bound: an unreachable collector never holds an exit
    )
    processor = (
        BatchSpanProcessor(exporter, schedule_delay_millis=500) if batch else SimpleSpanProcessor(exporter)
    )
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("tandem")
    _current_span = trace.get_current_span
    ENABLED = True
    log.info("tracing to %s as %s (sample ratio %g)", config.otlp_endpoint, service_name, config.sample_ratio)
    return True


def shutdown(timeout_s: float = 1.0) -> None:
    """Flushes the spans still buffered (at process exit), for at most `timeout_s`."""
    if ENABLED:
        from opentelemetry import trace

        flush = getattr(trace.get_tracer_provider(), "force_flush", None)
        if flush is not None:
            flush(int(timeout_s * 1000))


def engine_env(config: TracingConfig | None) -> dict[str, str]:
    """The standard OpenTelemetry environment for an engine process (vLLM and simengine read it; each names its
    own `service.name`); empty when tracing is off. vLLM also needs `--otlp-traces-endpoint` (its launcher adds
    it)."""
    if config is None or not config.enabled:
        return {}
    env = {
        OTLP_TRACES_ENDPOINT: config.endpoint_url,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false" if config.otlp_tls else "true",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": f"{config.sample_ratio:g}",
    }
    if config.ca_file:
        env["OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"] = config.ca_file
    return env


def from_env(environ: Mapping[str, str]) -> TracingConfig | None:
    """The collector an engine was given by `engine_env` (None when none): simengine's way in."""
    url = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not url:
        return None
    tls = url.startswith("https://")
    host_port = url.split("://", 1)[-1].rstrip("/")
    ratio = environ.get("OTEL_TRACES_SAMPLER_ARG", "1")
    return TracingConfig(
        otlp_endpoint=host_port,
        sample_ratio=float(ratio),
        otlp_tls=tls,
        ca_file=environ.get("OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE") if tls else None,
    )


#: `context_of`'s answer for a `traceparent` whose sampled flag is off: nothing under it is recorded.
UNSAMPLED = object()
_propagator: Any = None


def _sampled(value: str) -> bool:
    """The sampled bit of a `traceparent` (`00-<trace id>-<span id>-<flags>`: bit 0 of the flags)."""
    return len(value) >= 55 and value[-1] in "13579bdfBDF"


def context_of(carrier: Mapping[str, str] | None) -> Any:
    """The parent context a `traceparent` in `carrier` (headers or gRPC metadata, lower-case keys) names;
    `UNSAMPLED` when its sampled flag is off (read without parsing the rest: the cost of a ratio-0 mesh); None when
    there is none."""
    value = carrier.get(TRACEPARENT) if carrier else None
    if not value:
        return None
    if not _sampled(value):
        return UNSAMPLED
    return _w3c().extract(carrier)


def _w3c() -> Any:
    global _propagator
    if _propagator is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _propagator = TraceContextTextMapPropagator()
    return _propagator


def metadata_context(metadata: Any) -> Any:
    """`context_of` for a gRPC call's invocation metadata (pairs)."""
    if not metadata:
        return None
    carrier = {k: v for k, v in metadata if k in (TRACEPARENT, "tracestate") and isinstance(v, str)}
    return context_of(carrier)


_current_span: Any = None  # `opentelemetry.trace.get_current_span`, bound by `setup`


def _recording() -> bool:
    return _current_span().is_recording()


def traceparent() -> str:
    """The current span's `traceparent` (to pass on); "" outside a recorded span."""
    if not ENABLED or not _recording():
        return ""
    carrier: dict[str, str] = {}
    _w3c().inject(carrier)
    return carrier.get(TRACEPARENT, "")


_OFF = nullcontext()  # reusable: `span` returns it when nothing is recorded (no generator, no allocation)


def span(
    name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None, root: bool = False
) -> AbstractContextManager:
    """A span named `name` as the current span, child of `parent` (a context from `context_of`) or of the current
    span; yields the span, or None when nothing is recorded: tracing off, an unsampled parent, or no parent and no
    recorded current span (unless `root`: then a new trace, sampled by the ratio). So the ingress's sampling
    decides for the whole request, and a request Envoy did not sample costs a check per step."""
    if not ENABLED or parent is UNSAMPLED:
        return _OFF
    if parent is None and not root and not _recording():
        return _OFF
    return _tracer.start_as_current_span(name, context=parent, attributes=attributes)


def set_attributes(current: Any, attributes: Mapping[str, Any]) -> None:
    """Adds attributes to a span from `span` (None when tracing is off)."""
    if current is not None and current.is_recording():
        current.set_attributes(dict(attributes))


#: Methods a server span would cover for the life of a connection, or that run many times a second: not spanned.
UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.", "/envoy.service.")


def server_interceptor() -> Any:
    """A `grpc.aio` server interceptor spanning each unary call (`rpc <method>`, child of the caller's
    `traceparent` metadata when it sends one); None when tracing is off. Streams are not spanned (they live as long
    as their connection); per-request work on them is spanned by its handler (the conductor's Match)."""
    if not ENABLED:
        return None
    import grpc

    class TracingInterceptor(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, handler_call_details):
            handler = await continuation(handler_call_details)
            method = handler_call_details.method
            if handler is None or handler.unary_unary is None or method.startswith(UNTRACED_PREFIXES):
                return handler
            inner = handler.unary_unary
            parent = metadata_context(handler_call_details.invocation_metadata)

            async def traced(request, context):
                with span(f"rpc {method}", parent, {"rpc.system": "grpc", "rpc.method": method}, root=True):
                    return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(
                traced, handler.request_deserializer, handler.response_serializer
            )

    return TracingInterceptor()
