"""`dynamo`: NVIDIA Dynamo's KV router cost, re-implemented for side-by-side comparison.

Per candidate, in blocks of its `block_size` (read from Dynamo's `lib/kv-router` default selector and config,
2026; parameter names are Dynamo's):

    request_blocks   = ceil(isl / block_size)
    raw_prefill      = active_prefill_blocks + request_blocks
    credit           = overlap_score_credit * npu_blocks + host_cache_hit_weight * cpu_blocks
                       + disk_cache_hit_weight * disk_blocks
    adjusted_prefill = max(0, raw_prefill - credit)
    decode_blocks    = active_context_blocks + request_blocks
    cost             = prefill_load_scale * adjusted_prefill + decode_blocks
                       + decode_active_request_weight * active_requests

`active_prefill_blocks` are the prefill tokens this coordinator committed to the candidate, `active_context_blocks`
the context (prompt plus output) tokens of its requests in flight. With `router_temperature = 0` the lowest cost
wins, ties at random; with `T > 0` costs are min-max normalised and a candidate is drawn with probability
proportional to `exp(-(c - c_min) / ((c_max - c_min) * T))`. Randomness comes from a generator seeded by `seed`.
Dynamo's overlap-credit decay and shared-cache terms are off by default there and are not reproduced.

Load signal: Dynamo's router sits in the token path and marks a request's prefill complete when its first token
passes (`mark_prefill_completed`), so its active prefill tokens are exact. Inside Tandem this policy reads Tandem's
ledger, whose prefill leaves on the engines' prompt-token counter (`coordinator.workload`); the fleet simulator's
`dynamo` row uses Dynamo's own exact first-token release (`bench.fleet.sim.PEER_DEFAULTS`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.scheduling.interface import Candidate, PolicyType, RequestFacts
from coordinator.scheduling.params import parse_params

TYPE = "dynamo"


@dataclass(frozen=True, slots=True)
class Params:
    """Dynamo's defaults."""

    overlap_score_credit: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    prefill_load_scale: float = 1.0
    decode_active_request_weight: float = 0.0
    router_temperature: float = 0.0
    seed: int = 0


class Dynamo:
    """See the module docstring."""

    name = TYPE
    needs_match = True
    uses_predictions = False  # Dynamo scores on its KV-event index alone

    def __init__(self, params: Params = Params()) -> None:
        self.params = params
        self._random = random.Random(params.seed)

    def cost(self, request: RequestFacts, c: Candidate) -> float:
        """Dynamo's worker cost for one candidate (lower is better)."""
        p, m = self.params, c.match
        bs = c.state.info.block_size or m.block_size
        request_blocks = math.ceil(request.isl / bs)
        raw_prefill = c.prefill_tokens / bs + request_blocks
        credit = (
            p.overlap_score_credit * m.npu_blocks
            + p.host_cache_hit_weight * m.cpu_blocks
            + p.disk_cache_hit_weight * m.disk_blocks
        )
        decode_blocks = c.context_tokens / bs + request_blocks
        return (
            p.prefill_load_scale * max(0.0, raw_prefill - credit)
            + decode_blocks
            + p.decode_active_request_weight * c.inflight
        )

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        """Argmin (random ties) at temperature 0, else a softmax draw over normalised costs."""
        costs = [self.cost(request, c) for c in candidates]
        low, high = min(costs), max(costs)
        if self.params.router_temperature == 0 or high == low:
            return self._random.choice([c for c, cost in zip(candidates, costs, strict=True) if cost == low])
        scale = (high - low) * self.params.router_temperature
        weights = [math.exp(-(cost - low) / scale) for cost in costs]
        return self._random.choices(list(candidates), weights=weights, k=1)[0]


def create(raw: Mapping[str, Any] | None = None) -> Dynamo:
    """Factory used by the policy registry."""
    return Dynamo(parse_params(Params, raw, TYPE))


POLICY = PolicyType(TYPE, Params, create, section=TYPE)
