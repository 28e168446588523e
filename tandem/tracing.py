"""Distributed tracing (OpenTelemetry), off by default and then free.

The mesh file's `tracing` section (`tandem.tracing_config.TracingConfig`) names an OTLP/gRPC collector; `setup` installs an SDK tracer
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
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: True once `setup` installed an exporting tracer provider in this process; read on every request path.
ENABLED = False
_tracer: Any = None

TRACEPARENT = "traceparent"
#: The standard variable naming the collector of an engine process (`tracing_config.engine_env`).
OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


@dataclass(frozen=True, slots=True)
class Collector:
    """Where this process sends spans: `tandem.tracing_config.TracingConfig` (the mesh file) or `from_env` (an
    engine) give one. Plain data, so that an engine importing this module pulls in no config machinery."""

    otlp_endpoint: str  # host:port
    sample_ratio: float
    otlp_tls: bool = False
    ca_file: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.otlp_endpoint)

    @property
    def endpoint_url(self) -> str:
        """The collector as the OTLP exporters' `endpoint` (`http://` or `https://host:port`)."""
        return f"{'https' if self.otlp_tls else 'http'}://{self.otlp_endpoint}"


def setup(config: Any, service_name: str, *, batch: bool = True) -> bool:
    """Installs this process's tracer provider (`service.name` = `service_name`) exporting to the collector;
    returns whether tracing is on. `config`: a `Collector` or the mesh file's `TracingConfig` (same fields); does
    nothing when it names no collector."""
    global ENABLED, _tracer, _current_span
    if config is None or not config.enabled:
        return False
    from opentelemetry import trace

    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as e:  # xds-protos unpacked its older copies of opentelemetry-proto's files last
        from importlib.metadata import version

        pin = f"opentelemetry-proto=={version('opentelemetry-proto')}"
        raise RuntimeError(
            f"tracing: the OTLP exporter cannot load ({e}); reinstall {pin} after the other packages: "
            f"pip install --force-reinstall --no-deps {pin}"
        ) from e
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


def from_env(environ: Mapping[str, str]) -> Collector | None:
    """The collector an engine was given by `engine_env` (None when none): simengine's way in."""
    url = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not url:
        return None
    tls = url.startswith("https://")
    host_port = url.split("://", 1)[-1].rstrip("/")
    ratio = environ.get("OTEL_TRACES_SAMPLER_ARG", "1")
    return Collector(
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
