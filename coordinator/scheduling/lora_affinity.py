"""`lora_affinity`: Tandem's LoRA-aware policy: `kv_affinity`'s cost, plus where the request's adapter is resident,
what loading it elsewhere costs, and hysteresis so that adapters stay where they are.

A request for adapter `a` (`RequestFacts.adapter`; "" is the base model, scored by `kv_affinity` alone) can run on
an instance that holds `a` in one of its `max_loras` slots (`EngineLoad.adapters`, or routed there by this policy
within `placement_memory_s`: the heartbeat has not said so yet), or on one that can load it: a free slot, or an
idle adapter to evict (one not in `EngineLoad.active_adapters`). An instance whose slots are all held by adapters
with requests in flight would park the request until one drains; it is a candidate only when no other is.

For each candidate, with `base` the `kv_affinity` blend cost in prompt tokens (prefill still to compute, the
adapter's own KV hits credited: the conductor's match is per adapter, `tandem.chain_hash.adapter_root`, plus the
weighted work left on the instance), and `load` = `cold_load_s` turned into prompt tokens at the candidate's
learned prefill cost (`coordinator.latency`; the default prior while none is learned):

    cold      = cold_weight * load                                    # 0 where `a` is resident
    evict     = cold_weight * load * min(1, rate(victim) * rate_window_s)   # no free slot: an idle adapter goes
    score     = base + cold + evict                                   # no instance holds `a` yet
    score     = base + spread_factor * (cold + evict)                 # some instance holds `a` (hysteresis)

A second placement of an adapter is taken only when the load it relieves is worth its cost (`spread_factor`
times it: sticky placements, adapters do not move for a small load difference). Evicting costs what the victim
will cost to load again: the victim is the engine's least recently used idle adapter as this coordinator saw it
(its own routing history), weighed by how often that adapter was requested lately (`rate_window_s`), so a popular
adapter is not pushed out for a rare one while another instance has a colder slot. Ties go to fewer in-flight
requests, then in turn.

| parameter | default | meaning |
|---|---|---|
| `cold_load_s` | 0.25 | seconds to load an adapter into a slot (measured on the engines; `docs/scheduling.md`) |
| `cold_weight` | 0.4 | share of a load's time counted against the queue (see below) |
| `spread_factor` | 1.0 | hysteresis: how many times its load cost a new placement must relieve while the adapter is resident elsewhere (>= 1) |
| `placement_memory_s` | 1.0 | a placement counts as resident for this long before the heartbeat shows it |
| `rate_window_s` | 30.0 | time scale of the adapters' request rates (eviction cost) |
| every `kv_affinity` parameter | as there | the base cost (`load_weight`, `pressure_scale`, ...) |

The defaults are measured in the fleet simulator (`python -m bench.fleet lora`, `docs/benchmarks.md`): charging
the whole load time (`cold_weight` 1) and a `spread_factor` of 2 kept hot adapters on too few instances of a
32-instance fleet (their queues cost more than the loads saved) and sent requests away from instances holding the
adapter's KV but not the adapter (the prefix was computed again elsewhere; the hit rate fell by a sixth).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.latency import DEFAULT_PRIOR
from coordinator.scheduling import kv_affinity
from coordinator.scheduling.interface import Candidate, PolicyType, RequestFacts
from coordinator.scheduling.least_load import Rotation
from coordinator.scheduling.params import parse_params

TYPE = "lora_affinity"


@dataclass(frozen=True, slots=True)
class Params(kv_affinity.Params):
    """See the module docstring (and `kv_affinity.Params` for the base cost)."""

    cold_load_s: float = 0.25
    cold_weight: float = 0.4
    spread_factor: float = 1.0
    placement_memory_s: float = 1.0
    rate_window_s: float = 30.0

    def check(self) -> str | None:
        if self.spread_factor < 1.0:
            return f"spread_factor: must be >= 1 (below 1 placements are cheaper than holders), got {self.spread_factor}"
        return kv_affinity.Params.check(self)


@dataclass(frozen=True, slots=True)
class Slots:
    """What a candidate can do for an adapter."""

    resident: bool  # holds it (or was just routed it)
    free: bool  # has a free slot (no eviction needed)
    blocked: bool  # every slot held by an adapter with requests in flight: the request would wait


def slots(c: Candidate, adapter: str, recent: frozenset[str] = frozenset()) -> Slots:
    """The candidate's slots for `adapter`; `recent`: adapters this policy routed to it and the heartbeat does not
    show yet. An instance that reports no slots (`max_loras` 0) and no adapters is taken as having a free one."""
    load = c.state.load
    held = load.adapters | recent
    if adapter in held:
        return Slots(True, False, False)
    if not load.max_loras or len(held) < load.max_loras:
        return Slots(False, True, False)
    return Slots(False, False, not (held - load.active_adapters - recent))


def cold_tokens(p: Params, c: Candidate) -> float:
    """An adapter load on `c` in prompt tokens: the time the request waits for it at `c`'s prefill speed."""
    per_token = c.costs.prefill if c.costs is not None and c.costs.prefill > 0 else DEFAULT_PRIOR.prefill
    return p.cold_weight * p.cold_load_s / per_token


def evict_tokens(p: Params, c: Candidate, victim_rate: float) -> float:
    """Evicting an idle resident adapter requested `victim_rate` times a second: the share of a load it will need
    again within `rate_window_s`, in prompt tokens."""
    per_token = c.costs.prefill if c.costs is not None and c.costs.prefill > 0 else DEFAULT_PRIOR.prefill
    return p.cold_weight * p.cold_load_s / per_token * min(1.0, victim_rate * p.rate_window_s)


class LoraAffinity:
    """See the module docstring."""

    name = TYPE

    def __init__(self, params: Params = Params()) -> None:
        self.params = params
        base = {f.name: getattr(params, f.name) for f in dataclasses.fields(kv_affinity.Params)}
        self.kv = kv_affinity.KvAffinity(kv_affinity.Params(**base))
        self.needs_match = self.kv.needs_match
        self.uses_predictions = self.kv.uses_predictions
        self._rotation = Rotation()
        #: (instance id, adapter) -> when this policy last routed the adapter there (the candidates' clock:
        #: `EngineLoad.sampled_at`), so that a burst follows its first request before the heartbeat shows the load.
        self._placed: dict[tuple[str, str], float] = {}
        #: (instance id, adapter) -> when this policy last routed the adapter there: the engine evicts its least
        #: recently used idle adapter, and this is its order as far as this coordinator knows it.
        self._last: dict[tuple[str, str], float] = {}
        self._rates: dict[str, tuple[float, float]] = {}  # adapter -> (decayed request count / window, at)

    def scores(self, request: RequestFacts, pool: Sequence[Candidate]) -> dict[str, float]:
        """Each candidate's score (lower is better); blocked candidates are left out while any other remains."""
        p, adapter = self.params, request.adapter
        blend = dict(zip((c.instance_id for c in pool), self.kv.blend_costs(request, pool), strict=True))
        now = max((c.state.load.sampled_at for c in pool), default=0.0)
        views = {c.instance_id: slots(c, adapter, self._recent(c.instance_id, now)) for c in pool}
        held = any(v.resident for v in views.values())
        open_ = [c for c in pool if not views[c.instance_id].blocked] or list(pool)
        out: dict[str, float] = {}
        for c in open_:
            v = views[c.instance_id]
            cost = blend[c.instance_id]
            if not v.resident:
                load = cold_tokens(p, c) + (0.0 if v.free else evict_tokens(p, c, self._victim_rate(c, now)))
                cost += p.spread_factor * load if held else load
            out[c.instance_id] = cost
        return out

    def rate(self, adapter: str, now: float) -> float:
        """Requests per second for `adapter` lately (exponentially decayed over `rate_window_s`)."""
        r, at = self._rates.get(adapter, (0.0, now))
        return r * math.exp(-max(0.0, now - at) / self.params.rate_window_s)

    def _victim_rate(self, c: Candidate, now: float) -> float:
        """Request rate of the adapter the engine would evict: its least recently routed idle resident one."""
        load = c.state.load
        idle = load.adapters - load.active_adapters
        if not idle:
            return 0.0
        iid = c.instance_id
        victim = min(sorted(idle), key=lambda a: self._last.get((iid, a), -math.inf))
        return self.rate(victim, now)

    def _recent(self, instance_id: str, now: float) -> frozenset[str]:
        memory = self.params.placement_memory_s
        return frozenset(
            a for (iid, a), at in self._placed.items() if iid == instance_id and now - at <= memory
        )

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        """The lowest score; ties to fewer in flight, then in turn."""
        if not request.adapter:
            return self.kv.pick(request, candidates)
        pool = list(candidates)
        scores = self.scores(request, pool)
        keys = {c.instance_id: (scores[c.instance_id], c.inflight) for c in pool if c.instance_id in scores}
        best = min(keys.values())
        chosen = self._rotation.choose([c for c in pool if keys.get(c.instance_id) == best])
        now = max((c.state.load.sampled_at for c in pool), default=0.0)
        self._placed[(chosen.instance_id, request.adapter)] = now
        self._last[(chosen.instance_id, request.adapter)] = now
        self._rates[request.adapter] = (
            self.rate(request.adapter, now) + 1.0 / self.params.rate_window_s,
            now,
        )
        if len(self._placed) > 4096:  # forget placements the heartbeats have long confirmed or denied
            self._placed = {
                k: at for k, at in self._placed.items() if now - at <= self.params.placement_memory_s
            }
        return chosen


def create(raw: Mapping[str, Any] | None = None) -> LoraAffinity:
    """Factory used by the policy registry."""
    return LoraAffinity(parse_params(Params, raw, TYPE))


POLICY = PolicyType(TYPE, Params, create, section=TYPE)
