"""`kv_affinity`: Tandem's KV-aware policy: prefill work saved by cached prefixes, blended with load.

For each candidate, from the conductor's exclusive per-medium hits (`npu`, `cpu`, `disk` leading blocks):

    affinity_matched = min(round((npu * w_npu + cpu * w_cpu + disk * w_disk) * block_size), isl)
    prefill_cost     = max(0, isl - overlap_credit * affinity_matched)

and, with `load_tokens` the candidate's work left on the ledger (prefill still to compute plus
`decode_load_weight` times decode tokens still to generate):

- mode `blend` (default): pick the lowest `prefill_load_scale * prefill_cost + load_weight * load_tokens`;
- mode `prefix`: pick the longest `affinity_matched`, then the lowest blend cost;
- mode `load`: pick the lowest `load_tokens` (KV facts ignored).

With `load_gate_topn = N > 0`, only the N least-loaded candidates (by `load_tokens`, ties by instance id) are
scored, so that a hot prefix cannot pile every request onto one overloaded instance. Remaining ties go to fewer
in-flight requests, then in turn.

| parameter | default | meaning |
|---|---|---|
| `mode` | `blend` | `blend`, `prefix` or `load` |
| `load_weight` | 0.5 | weight of the work left on the candidate (a cached token is worth two queued ones) |
| `decode_load_weight` | 0.25 | weight of a decode token left against a prefill token left, within the load |
| `overlap_credit` | 1.0 | share of a cached token's prefill that is saved (0..1) |
| `prefill_load_scale` | 1.0 | weight of this request's prefill cost |
| `load_gate_topn` | 0 | score only the N least-loaded candidates (0: all) |
| `w_npu`, `w_cpu`, `w_disk` | 1.0, 1.0, 0.0 | credit per cached block by medium |
| `predicted_cache` | false | count prompts just routed as cached (`coordinator.predicted_cache`) |

The defaults are measured (`docs/scheduling.md`, "Choosing the defaults"): with `load_weight` 1 (a greedy
per-request TTFT estimate) hot prefixes get replicated near saturation and the hit rate falls; 0.5 held at both
load levels and on every workload tested, and counting a decode token left as a quarter of a prefill token kept
sessions with long answers from looking busier than they are.
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
    load_weight: float = 0.5
    decode_load_weight: float = 0.25
    overlap_credit: float = 1.0
    prefill_load_scale: float = 1.0
    load_gate_topn: int = 0
    w_npu: float = 1.0
    w_cpu: float = 1.0
    w_disk: float = 0.0
    predicted_cache: bool = False

    def check(self) -> str | None:
        if self.overlap_credit > 1.0:
            return f"overlap_credit: must be between 0 and 1, got {self.overlap_credit}"
        return None


def affinity_matched(p: Params, c: Candidate, isl: int) -> int:
    """Cached prompt tokens credited to a candidate, weighted by medium, at most the prompt."""
    m = c.match
    weighted = (m.npu_blocks * p.w_npu + m.cpu_blocks * p.w_cpu + m.disk_blocks * p.w_disk) * m.block_size
    return min(round(weighted), isl)


def prefill_cost(p: Params, c: Candidate, isl: int) -> float:
    """Prompt tokens the candidate would still have to compute."""
    return max(0.0, isl - p.overlap_credit * affinity_matched(p, c, isl))


class KvAffinity:
    """See the module docstring."""

    name = TYPE

    def __init__(self, params: Params = Params()) -> None:
        self.params = params
        self.needs_match = params.mode != "load"
        self.uses_predictions = self.needs_match and params.predicted_cache
        self._rotation = Rotation()

    def cost(self, request: RequestFacts, c: Candidate) -> float:
        """The blend cost of one candidate."""
        p = self.params
        return p.prefill_load_scale * prefill_cost(p, c, request.isl) + p.load_weight * self.load(c)

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
                c.instance_id: (-affinity_matched(p, c, request.isl), self.cost(request, c), c.inflight)
                for c in pool
            }
        else:
            keys = {c.instance_id: (self.cost(request, c), c.inflight) for c in pool}
        best = min(keys.values())
        return self._rotation.choose([c for c in pool if keys[c.instance_id] == best])


def create(raw: Mapping[str, Any] | None = None) -> KvAffinity:
    """Factory used by the policy registry."""
    return KvAffinity(parse_params(Params, raw, TYPE))


POLICY = PolicyType(TYPE, Params, create, section=TYPE)
