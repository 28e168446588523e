"""An engine's load as vLLM reports it on `/metrics`: read by node agents, carried in heartbeats, used by the
coordinator's policies."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(slots=True)
class EngineLoad:
    """Load of one engine API server."""

    running: int = 0  # vllm:num_requests_running
    waiting: int = 0  # vllm:num_requests_waiting
    kv_cache_usage: float = 0.0  # vllm:kv_cache_usage_perc, a fraction
    sampled_at: float = 0.0  # wall clock of the scrape; 0 when never sampled


def parse_load(text: str) -> EngineLoad:
    """vLLM's load gauges, summed over engines/ranks of one server (older `gpu_cache_usage_perc` accepted)."""
    load = EngineLoad(sampled_at=time.time())
    usage: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                load.running += int(sample.value)
            elif sample.name == "vllm:num_requests_waiting":
                load.waiting += int(sample.value)
            elif sample.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                usage.append(sample.value)
    load.kv_cache_usage = max(usage) if usage else 0.0
    return load
