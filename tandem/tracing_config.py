"""The mesh file's `tracing` section and the engines' OpenTelemetry environment it gives (`tandem.tracing` runs
it; kept apart so that engines importing `tandem.tracing` load no config models)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.netaddr import Address
from tandem.tracing import OTLP_TRACES_ENDPOINT


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
