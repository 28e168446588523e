"""Engines launched by an agent of a traced mesh are told the collector (`--otlp-traces-endpoint`, as vLLM)."""

from __future__ import annotations

import dataclasses

from node_agent.app import with_otlp_traces
from node_agent.launch import LaunchSpec
from tandem.tracing_config import TracingConfig, engine_env


def test_an_engine_with_the_collector_in_its_environment_gets_the_flag_once():
    env = engine_env(TracingConfig(otlp_endpoint="otel.monitoring:4317"))
    spec = LaunchSpec(name="e", argv=["vllm", "serve"], env=env)
    traced = with_otlp_traces(spec)
    assert traced.argv[-2:] == ["--otlp-traces-endpoint", "http://otel.monitoring:4317"]
    assert with_otlp_traces(traced) == traced  # never twice
    plain = dataclasses.replace(spec, env={})
    assert with_otlp_traces(plain) is plain  # tracing off: the engine's command is unchanged
