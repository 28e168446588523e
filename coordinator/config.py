"""The `coordinator:` section of the mesh file."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tandem.netaddr import split_host_port


class SchedulerConfig(BaseModel):
    """How the coordinator picks an instance among the healthy ones serving the request's model."""

    model_config = ConfigDict(extra="forbid")

    policy: Literal["round_robin", "least_load"] = "least_load"
    """`round_robin`: in turn. `least_load`: fewest committed tokens (prompt + requested output) in flight."""


class CoordinatorConfig(BaseModel):
    """The coordinator process: ext_proc endpoint picker, Registry, Admin and Metaserver on one gRPC port."""

    model_config = ConfigDict(extra="forbid")

    listen: str = "127.0.0.1:9100"
    """gRPC address (ext_proc for Envoy, Registry for agents, Admin and Metaserver through Envoy's :9000)."""
    metrics_listen: str = "127.0.0.1:9101"
    """Prometheus `/metrics` address."""
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    """How often agents report; an instance silent for three intervals is marked unhealthy."""
    default_max_tokens: int = Field(default=16, gt=0)
    """Output tokens counted for a completions request without `max_tokens` (vLLM's default is 16)."""
    chat_default_max_tokens: int = Field(default=256, gt=0)
    """Output tokens counted for a chat request without `max_tokens`/`max_completion_tokens`."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """Scheduling policy."""

    @field_validator("listen", "metrics_listen")
    @classmethod
    def _address(cls, value: str) -> str:
        split_host_port(value)
        return value
