"""`sglang_cache_aware`: SGLang router's `cache_aware` policy, routed by the conductor's facts.

As SGLang's router decides (`sgl-router/src/policies/cache_aware.rs`, 2026), with `load` the requests in flight
through this coordinator:
1. If `max_load - min_load > balance_abs_threshold` and `max_load > min_load * balance_rel_threshold` (over all
   candidates), the load is imbalanced: pick the least-loaded candidate (first in id order on ties).
2. Otherwise take the candidate with the longest cached prefix; if its match rate `matched_tokens / isl` exceeds
   `cache_threshold`, pick it.
3. Otherwise pick the least-loaded candidate (`below_threshold: least_load`, the default): sglang-router 0.3.2 as
   shipped on PyPI decides so, reproduced decision for decision by `bench/sglang_parity.py` (the router in front of
   recording engines). `smallest_tree` is what the router's older documentation describes: the candidate with the
   smallest cache tree, here the fewest distinct prompt tokens routed to it so far (each routed prompt adds what
   its tree did not hold yet, as the router's `tenant_char_count`, `sgl-router/src/tree.rs`, `Tree::insert`).
Where the prefix match comes from (`tree`):
- `routed` (default, as the real router): SGLang's router keeps its own approximate tree per worker and inserts
  each prompt into the chosen worker's tree at routing time, never confirmed by the engine; here a
  `coordinator.predicted_cache.PredictedCache` without expiry over the prompt's chain hashes (the router evicts
  least-recently-used entries every 60 s above `max_tree_size`, 2^26 characters, which the benchmarks never reach;
  this bound counts `max_tree_blocks` (block, worker) entries instead);
- `kv_events`: the conductor's facts (what the engines report holding), as Tandem's own policies use.
SGLang matches characters; Tandem matches token blocks of the candidates' block size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from coordinator.predicted_cache import PredictedCache
from coordinator.scheduling.interface import Candidate, PolicyType, RequestFacts
from coordinator.scheduling.params import parse_params

TYPE = "sglang_cache_aware"


@dataclass(frozen=True, slots=True)
class Params:
    """SGLang's defaults."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    below_threshold: Literal["smallest_tree", "least_load"] = "least_load"
    tree: Literal["routed", "kv_events"] = "routed"
    max_tree_blocks: int = 1 << 22

    def check(self) -> str | None:
        if self.cache_threshold > 1.0:
            return f"cache_threshold: must be between 0 and 1, got {self.cache_threshold}"
        if self.balance_rel_threshold < 1.0:
            return f"balance_rel_threshold: must be >= 1, got {self.balance_rel_threshold}"
        return None


class SglangCacheAware:
    """See the module docstring."""

    name = TYPE
    needs_match = True
    uses_predictions = False  # its own routed-prompt tree instead (see `tree`)

    def __init__(self, params: Params = Params()) -> None:
        self.params = params
        self._tree_tokens: dict[str, int] = {}
        self._tree = PredictedCache(math.inf, max_entries=params.max_tree_blocks)

    def _matched_tokens(self, request: RequestFacts, ordered: Sequence[Candidate]) -> dict[str, int]:
        if self.params.tree == "kv_events":
            return {c.instance_id: c.match.matched_tokens for c in ordered}
        blocks = self._tree.blocks(request.prompt_hashes, [c.instance_id for c in ordered])
        return {c.instance_id: blocks.get(c.instance_id, 0) * c.state.info.block_size for c in ordered}

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        """Load balance when imbalanced, else cache affinity above the threshold, else the smallest tree."""
        p = self.params
        ordered = sorted(candidates, key=lambda c: c.instance_id)
        loads = [c.inflight for c in ordered]
        least_loaded = min(ordered, key=lambda c: c.inflight)
        matched = self._matched_tokens(request, ordered)
        if (
            max(loads) - min(loads) > p.balance_abs_threshold
            and max(loads) > min(loads) * p.balance_rel_threshold
        ):
            chosen = least_loaded
        else:
            best = max(ordered, key=lambda c: matched[c.instance_id])
            rate = matched[best.instance_id] / request.isl if request.isl else 0.0
            if rate > p.cache_threshold:
                chosen = best
            elif p.below_threshold == "least_load":
                chosen = least_loaded
            else:
                chosen = min(ordered, key=lambda c: self._tree_tokens.get(c.instance_id, 0))
        new = max(0, request.isl - matched[chosen.instance_id])
        self._tree_tokens[chosen.instance_id] = self._tree_tokens.get(chosen.instance_id, 0) + new
        if self.params.tree == "routed":
            self._tree.routed(chosen.instance_id, request.prompt_hashes)
        return chosen


def create(raw: Mapping[str, Any] | None = None) -> SglangCacheAware:
    """Factory used by the policy registry."""
    return SglangCacheAware(parse_params(Params, raw, TYPE))


POLICY = PolicyType(TYPE, Params, create, section=TYPE)
