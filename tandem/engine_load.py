"""An engine's load as vLLM reports it on `/metrics`: read by node agents, carried in heartbeats, used by the
coordinator's policies."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field


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
    #: KV pulls of this (decode) engine, cumulative, summed over ranks; 0 when it does not pull over NIXL: those
    #: that succeeded (vLLM's `vllm:nixl_bytes_transferred_count`) and those that failed
    #: (`vllm:nixl_num_failed_transfers_total`).
    kv_transfers: int = 0
    kv_transfer_failures: int = 0


def parse_load(text: str) -> EngineLoad:
    """vLLM's load gauges, summed over engines/ranks of one server (older `gpu_cache_usage_perc` accepted), and
    its progress counters per rank.

    A scanner of Prometheus' text format made for this (an agent reads every engine's `/metrics` four times a
    second): it looks only at the lines of the few series above and parses labels only on those, where
    `prometheus_client`'s parser builds every family of the page (a vLLM page is mostly histograms); it reads
    the same values (tests/tandem/test_engine_load.py compares them on simengine's and vLLM's pages)."""
    load = EngineLoad(sampled_at=time.time())
    usage: list[float] = []
    prompt: dict[int, int] = {}
    generation: dict[int, int] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue  # comments, other exporters' series
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, close = line[:brace], line.rfind("}")
            if close < brace or name not in _WANTED:
                continue
            labels = _LABEL.findall(line, brace + 1, close)
            rest = line[close + 1 :]
        else:
            name = line[:space] if space != -1 else line
            if name not in _WANTED:
                continue
            labels, rest = [], line[len(name) :]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if name in _COUNTERS:
            rank = _rank(_label(labels, "engine"))
            into = prompt if name == _COUNTERS[0] else generation
            into[rank] = into.get(rank, 0) + int(value)
        elif name == _HITS:
            rank = _rank(_label(labels, "engine"))
            load.prefix_hits[rank] = load.prefix_hits.get(rank, 0) + int(value)
        elif name == _NIXL_FAILED:
            load.kv_transfer_failures += int(value)
        elif name == _NIXL_DONE:
            load.kv_transfers += int(value)
        elif name == "vllm:num_requests_running":
            load.running += int(value)
        elif name == "vllm:num_requests_waiting":
            load.waiting += int(value)
        elif name == "vllm:cache_config_info":
            blocks = sum(_count(_label(labels, k)) for k in ("num_gpu_blocks", "num_cpu_blocks"))
            load.kv_blocks = max(load.kv_blocks, blocks)
        else:  # kv_cache_usage_perc, or the older gpu_cache_usage_perc
            usage.append(value)
    load.kv_cache_usage = max(usage) if usage else 0.0
    load.progress = {
        r: (prompt.get(r, 0), generation.get(r, 0)) for r in sorted(prompt.keys() | generation.keys())
    }
    return load


_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
_HITS = "vllm:prefix_cache_hits_total"
_NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
_NIXL_DONE = "vllm:nixl_bytes_transferred_count"
_WANTED = frozenset(
    {
        *_COUNTERS,
        _HITS,
        _NIXL_FAILED,
        _NIXL_DONE,
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
    }
)
#: One `name="value"` label pair of the text format (the value may hold escaped quotes).
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _label(labels: list[tuple[str, str]], key: str) -> str | None:
    for k, v in labels:
        if k == key:
            return v
    return None


def _count(label: str | None) -> int:
    """A block count label ("None" or absent: 0)."""
    try:
        return max(0, int(label or 0))
    except ValueError:
        return 0


def _rank(label: str | None) -> int:
    """A DP rank label (absent: rank 0)."""
    try:
        return int(label or 0)
    except ValueError:
        return 0
