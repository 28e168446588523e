"""`kv_affinity`: Tandem's KV-aware policy: prefill work saved by cached prefixes, blended with load.

For each candidate, from the conductor's exclusive per-medium hits (`npu`, `cpu`, `disk` leading blocks):

    affinity_matched = min(round((npu * w_npu + cpu * w_cpu + disk * w_disk) * block_size), isl)
    prefill_cost     = max(0, isl - overlap_credit * affinity_matched)

and, with `load_tokens` the candidate's work left on the ledger (prefill still to compute plus
`decode_load_weight` times decode tokens still to generate):

- mode `blend` (default): pick the lowest `prefill_load_scale * prefill_cost + weight * load_tokens`;
- mode `prefix`: pick the longest `affinity_matched`, then the lowest blend cost (at `load_weight`);
- mode `load`: pick the lowest `load_tokens` (KV facts ignored).

The load's weight follows the fleet's pressure. With `size` a running mean of requests' uncached prompt tokens
(the least any candidate would compute, averaged over recent requests) and `mean_load` the candidates' mean
`load_tokens`:

    weight = load_weight * min(1, pressure_scale * size / mean_load)

At the defaults (both 1) that is `min(1, size / mean_load)`. While the mean queue holds less than one request's
prompt, a queued token weighs as much as a token to compute: the blend is the request's own TTFT in tokens (the
work it waits behind plus the work it brings), and a burst spreads where waiting would cost more than recomputing.
Past that, every instance has a queue of about `q = mean_load / size` requests, and a prefix computed again on a
second instance is capacity lost for the requests queued behind it there: the copy costs about `q` times the
prefill it repeats, so the load weighs `1 / q`. A prefix then stays where it is cached (and is not copied into a
second, small cache, evicting someone else's blocks) unless the load it would relieve is that growing multiple of
the work it saves.

With `load_gate_topn = N > 0`, only the N least-loaded candidates (by `load_tokens`, ties by instance id) are
scored, so that a hot prefix cannot pile every request onto one overloaded instance. Remaining ties go to fewer
in-flight requests, then in turn.

| parameter | default | meaning |
|---|---|---|
| `mode` | `blend` | `blend`, `prefix` or `load` |
| `load_weight` | 1.0 | weight of the work left on the candidate while queues are short (a queued token costs what a token to compute does) |
| `decode_load_weight` | 0.25 | weight of a decode token left against a prefill token left, within the load |
| `overlap_credit` | 1.0 | share of a cached token's prefill that is saved (0..1) |
| `prefill_load_scale` | 1.0 | weight of this request's prefill cost |
| `load_gate_topn` | 0 | score only the N least-loaded candidates (0: all) |
| `w_npu`, `w_cpu`, `w_disk` | 1.0, 1.0, 0.0 | credit per cached block by medium |
| `pressure_scale` | 1.0 | queued requests per instance (in units of `size`) beyond which the load's weight falls (0: fixed `load_weight`) |
| `predicted_cache` | true | count prompts just routed as cached (`coordinator.predicted_cache`) |

The defaults are measured (`docs/scheduling.md`, "Choosing the defaults"): a fixed weight (0.5 or 1) copied hot
prefixes into every small cache past saturation (the hit rate fell by a fifth and mean TTFT doubled against SGLang's
router); the pressure scaling and the predicted cache (a burst of a new prefix follows its first request instead of
spreading while the first one is still queued) hold the prefixes in place. Below pressure, the greedy weight 1 beat
the earlier 0.5 (a cached token worth two queued ones), which sent requests behind a busy holder's queue at light
load. Counting a decode token left as a quarter of a prefill token keeps sessions with long answers from looking
busier than they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from coordinator.scheduling.interface import Candidate, PolicyType, RequestFacts
from coordinator.scheduling.least_load import Rotation
from coordinator.scheduling.params import parse_params

TYPE = "kv_affinity"


@dataclass(frozen=True, slots=True)
class Params:
    """See the module docstring."""

    mode: Literal["blend", "prefix", "load"] = "blend"
    load_weight: float = 1.0
    decode_load_weight: float = 0.25
    overlap_credit: float = 1.0
    prefill_load_scale: float = 1.0
    load_gate_topn: int = 0
    w_npu: float = 1.0
    w_cpu: float = 1.0
    w_disk: float = 0.0
    predicted_cache: bool = True
    pressure_scale: float = 1.0

    def check(self) -> str | None:
        if self.overlap_credit > 1.0:
            return f"overlap_credit: must be between 0 and 1, got {self.overlap_credit}"
        if self.pressure_scale < 0:
            return f"pressure_scale: must be >= 0, got {self.pressure_scale}"
        return None


def affinity_matched(p: Params, c: Candidate, isl: int) -> int:
    """Cached prompt tokens credited to a candidate, weighted by medium, at most the prompt."""
    m = c.match
    weighted = (m.npu_blocks * p.w_npu + m.cpu_blocks * p.w_cpu + m.disk_blocks * p.w_disk) * m.block_size
    return min(round(weighted), isl)


def prefill_cost(p: Params, c: Candidate, isl: int) -> float:
    """Prompt tokens the candidate would still have to compute."""
    return max(0.0, isl - p.overlap_credit * affinity_matched(p, c, isl))


#: Weight of the newest request in the running mean of requests' uncached prompt tokens.
SIZE_EMA = 0.05


class KvAffinity:
    """See the module docstring."""

    name = TYPE

    def __init__(self, params: Params = Params()) -> None:
        self.params = params
        self.needs_match = params.mode != "load"
        self.uses_predictions = self.needs_match and params.predicted_cache
        self._rotation = Rotation()
        self._mean_size = 0.0  # running mean of requests' uncached prompt tokens (SIZE_EMA)

    def load_weight(self, request: RequestFacts, pool: Sequence[Candidate]) -> float:
        """`load_weight * min(1, pressure_scale * size / mean_load)`: the load weighs less as queues grow."""
        return self._weight(
            [prefill_cost(self.params, c, request.isl) for c in pool], [self.load(c) for c in pool]
        )

    def _weight(self, prefill: Sequence[float], loads: Sequence[float]) -> float:
        """`load_weight` from the pool's prefill costs and loads (each candidate's, in one order)."""
        p = self.params
        size = max(1.0, min(prefill))
        self._mean_size = size if not self._mean_size else (1 - SIZE_EMA) * self._mean_size + SIZE_EMA * size
        mean_load = sum(loads) / len(loads)
        if not p.pressure_scale or not mean_load:
            return p.load_weight
        return p.load_weight * min(1.0, p.pressure_scale * self._mean_size / mean_load)

    def blend_costs(self, request: RequestFacts, pool: Sequence[Candidate]) -> list[float]:
        """Each candidate's blend cost, in pool order, at the pool's load weight (one pass over the candidates)."""
        prefill = [prefill_cost(self.params, c, request.isl) for c in pool]
        loads = [self.load(c) for c in pool]
        weight = self._weight(prefill, loads)
        scale = self.params.prefill_load_scale
        return [scale * cost + weight * load for cost, load in zip(prefill, loads, strict=True)]

    def cost(self, request: RequestFacts, c: Candidate, weight: float) -> float:
        """The blend cost of one candidate."""
        p = self.params
        return p.prefill_load_scale * prefill_cost(p, c, request.isl) + weight * self.load(c)

    def load(self, c: Candidate) -> float:
        """Work left on a candidate: prefill still to compute plus weighted decode tokens still to generate."""
        return c.prefill_tokens + self.params.decode_load_weight * c.decode_tokens

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        """The candidate with the best score under the configured mode."""
        p = self.params
        pool = list(candidates)
        if p.load_gate_topn and len(pool) > p.load_gate_topn:
            pool = sorted(pool, key=lambda c: (self.load(c), c.instance_id))[: p.load_gate_topn]
        keys: dict[str, tuple[float, ...]]
        if p.mode == "load":
            keys = {c.instance_id: (self.load(c), c.inflight) for c in pool}
        elif p.mode == "prefix":
            keys = {
                c.instance_id: (
                    -affinity_matched(p, c, request.isl),
                    self.cost(request, c, p.load_weight),
                    c.inflight,
                )
                for c in pool
            }
        else:
            costs = self.blend_costs(request, pool)
            keys = {c.instance_id: (cost, c.inflight) for c, cost in zip(pool, costs, strict=True)}
        best = min(keys.values())
        return self._rotation.choose([c for c in pool if keys[c.instance_id] == best])


def create(raw: Mapping[str, Any] | None = None) -> KvAffinity:
    """Factory used by the policy registry."""
    return KvAffinity(parse_params(Params, raw, TYPE))


POLICY = PolicyType(TYPE, Params, create, section=TYPE)
