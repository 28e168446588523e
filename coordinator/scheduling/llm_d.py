"""`llm_d`: llm-d's default scheduling profile (weighted scorers, max-score picker), for comparison.

As llm-d's endpoint picker scores (`pkg/epp/config/loader/defaults.go` and the scorer plug-ins, 2026), each scorer
gives a candidate a score in [0, 1], the profile sums `weight * score`, and the highest total wins (ties at random,
from a generator seeded by `seed`):
- prefix (`prefix_weight`, default 3): matched blocks / prompt blocks, from the conductor's facts (llm-d's default
  estimates matches from its own routing history; its precise variant uses KV events, as here);
- KV utilisation (`kv_utilization_weight`, default 2): `1 - kv_cache_usage`;
- queue (`queue_weight`, default 2): `(max_waiting - waiting) / (max_waiting - min_waiting)` over the candidates,
  1 when all are equal. Utilisation and queue come from the engines' `/metrics`, as the agents report them;
- LoRA affinity (`lora_affinity_weight`, default 1, as llm-d's LoRA profile weighs its `lora-affinity-scorer`), for
  a request naming an adapter only: 1 when the adapter has requests running or waiting there
  (`EngineLoad.active_adapters`, vLLM's `vllm:lora_requests_info`), else 0.8 while the adapters with requests there
  are fewer than `max_loras`, else 0 (llm-d-router `pkg/epp/framework/plugins/scheduling/scorer/loraaffinity`,
  `LoraAffinityScorer.Score`, 2026: its 0.6 for "waiting only" is unreachable with vLLM, where waiting implies
  active).

Freshness: llm-d's endpoint picker scrapes every endpoint's metrics every 50 ms by default
(`--refresh-metrics-interval`); Tandem's node agents relay them every `load_interval_s` (0.25 s). The fleet
simulator's `llm_d` row uses llm-d's 50 ms (`bench.fleet.sim.PEER_DEFAULTS`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.scheduling.interface import Candidate, PolicyType, RequestFacts
from coordinator.scheduling.params import parse_params

TYPE = "llm_d"


@dataclass(frozen=True, slots=True)
class Params:
    """llm-d's default weights."""

    prefix_weight: float = 3.0
    kv_utilization_weight: float = 2.0
    queue_weight: float = 2.0
    lora_affinity_weight: float = 1.0
    seed: int = 0


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


def lora_score(c: Candidate, adapter: str) -> float:
    """llm-d's `lora-affinity-scorer`: 1 active there, 0.8 while a slot is free, else 0."""
    load = c.state.load
    if adapter in load.active_adapters:
        return 1.0
    return 0.8 if len(load.active_adapters) < load.max_loras else 0.0


class LlmD:
    """See the module docstring."""

    name = TYPE
    needs_match = True
    uses_predictions = False

    def __init__(self, params: Params = Params()) -> None:
        self.params = params
        self._random = random.Random(params.seed)

    def scores(self, request: RequestFacts, candidates: Sequence[Candidate]) -> list[float]:
        """The weighted total of every candidate."""
        p = self.params
        waiting = [c.state.load.waiting for c in candidates]
        low, high = min(waiting), max(waiting)
        totals = []
        for c, q in zip(candidates, waiting, strict=True):
            blocks = math.ceil(request.isl / c.match.block_size) if request.isl else 0
            matched = c.match.npu_blocks + c.match.cpu_blocks + c.match.disk_blocks
            prefix = matched / blocks if blocks else 0.0
            queue = 1.0 if high == low else (high - q) / (high - low)
            kv = 1.0 - c.state.load.kv_cache_usage
            totals.append(
                p.prefix_weight * _clamp(prefix)
                + p.kv_utilization_weight * _clamp(kv)
                + p.queue_weight * _clamp(queue)
                + (p.lora_affinity_weight * lora_score(c, request.adapter) if request.adapter else 0.0)
            )
        return totals

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        """The highest weighted score; ties at random."""
        totals = self.scores(request, candidates)
        best = max(totals)
        return self._random.choice([c for c, t in zip(candidates, totals, strict=True) if t == best])


def create(raw: Mapping[str, Any] | None = None) -> LlmD:
    """Factory used by the policy registry."""
    return LlmD(parse_params(Params, raw, TYPE))


POLICY = PolicyType(TYPE, Params, create, section=TYPE)
