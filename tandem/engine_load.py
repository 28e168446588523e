"""An engine's load as vLLM reports it on `/metrics`: read by node agents, carried in heartbeats, used by the
coordinator's policies."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass(slots=True)
class EngineLoad:
    """Load of one engine API server."""

    running: int = 0  # vllm:num_requests_running
    waiting: int = 0  # vllm:num_requests_waiting
    kv_cache_usage: float = 0.0  # vllm:kv_cache_usage_perc, a fraction
    sampled_at: float = 0.0  # wall clock of the scrape; 0 when never sampled
    #: Per DP rank (vLLM's `engine` label), the cumulative (`vllm:prompt_tokens_total`,
    #: `vllm:generation_tokens_total`); empty when the engine exposes neither.
    progress: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: KV blocks one rank can hold (`num_gpu_blocks` + `num_cpu_blocks` of `vllm:cache_config_info`, the largest
    #: over ranks); 0 when the engine does not say.
    kv_blocks: int = 0
    #: Per DP rank, the cumulative `vllm:prefix_cache_hits_total` (prompt tokens found cached); empty when absent.
    prefix_hits: dict[int, int] = field(default_factory=dict)
    #: LoRA adapters resident on the engine (its `max_loras` slots), by name: the seam the node agent fills from
    #: the heartbeat's `EngineLoad.loaded_adapters`; empty when the engine serves no adapters or does not say.
    adapters: frozenset[str] = frozenset()
    #: Adapters with requests running or waiting on the engine (vLLM's `vllm:lora_requests_info`
    #: `running_lora_adapters` and `waiting_lora_adapters`): a subset of `adapters` that cannot be evicted now.
    active_adapters: frozenset[str] = frozenset()
    #: Adapter slots of the engine (vLLM's `--max-loras`; heartbeat `EngineLoad.max_loras`); 0: not reported.
    max_loras: int = 0


def parse_load(text: str) -> EngineLoad:
    """vLLM's load gauges, summed over engines/ranks of one server (older `gpu_cache_usage_perc` accepted), and
    its progress counters per rank."""
    load = EngineLoad(sampled_at=time.time())
    usage: list[float] = []
    prompt: dict[int, int] = {}
    generation: dict[int, int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name in _COUNTERS:
                rank = _rank(sample.labels.get("engine", "0"))
                into = prompt if name == _COUNTERS[0] else generation
                into[rank] = into.get(rank, 0) + int(sample.value)
            elif name == _HITS:
                rank = _rank(sample.labels.get("engine", "0"))
                load.prefix_hits[rank] = load.prefix_hits.get(rank, 0) + int(sample.value)
            elif name == "vllm:num_requests_running":
                load.running += int(sample.value)
            elif sample.name == "vllm:num_requests_waiting":
                load.waiting += int(sample.value)
            elif sample.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                usage.append(sample.value)
            elif name == "vllm:cache_config_info":
                blocks = sum(_count(sample.labels.get(k)) for k in ("num_gpu_blocks", "num_cpu_blocks"))
                load.kv_blocks = max(load.kv_blocks, blocks)
    load.kv_cache_usage = max(usage) if usage else 0.0
    load.progress = {
        r: (prompt.get(r, 0), generation.get(r, 0)) for r in sorted(prompt.keys() | generation.keys())
    }
    return load


_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
_HITS = "vllm:prefix_cache_hits_total"


def _count(label: str | None) -> int:
    """A block count label ("None" or absent: 0)."""
    try:
        return max(0, int(label or 0))
    except ValueError:
        return 0


def _rank(label: str) -> int:
    try:
        return int(label)
    except ValueError:
        return 0
