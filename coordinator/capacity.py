"""P:D sizing: each model's prefill and decode utilisation (demand over learned capacity) and the split of its
instances that would balance them (pure core).

**Demand**, per model over a recent window (`DemandMeter`, fed by the instances' progress reports):
- prompt tokens to compute per second, after cache hits: the prompt tokens the engines computed plus the growth of
  the ledger's queued prefill (what arrived = what was done + what now waits), so that a saturated pool reads
  above 1 rather than at its own throughput;
- output tokens per second: what the engines generated (a decode pool's queue is not visible to the coordinator:
  a saturated decode pool reads about 1);
- the mean context of a decoding sequence (prompt plus output so far), weighted by tokens generated.

**Capacity**, per instance, from its learned step costs (`coordinator.latency`):
- prefill: tokens per second at full chunks, `budget / (step + prefill * budget)`;
- decode: tokens per second at the largest batch it can run, `B / step_s(B, C)` with `C` the demand's mean
  context and `B` the smallest of `max_seqs`, the sequences of context `C` its KV blocks hold (when the engine
  says how many it has), and, when `itl_s` is set, the batch whose step stays within that inter-token latency.

**Utilisation** is demand over the pool's summed capacity: 0 when idle, 1 at capacity, above 1 when demand
exceeds it (infinite when a role has demand and no instance). A model whose instances are all hybrid is one pool:
its utilisation is the sum of the two fractions (the time a step spends on each), and no split is suggested.
A P/D model's pools are its prefill and its decode instances (a hybrid instance among them counts in neither).

**Suggested split**: the same number of instances (`P + D`, each at least 1) divided so that the larger of the
two utilisations is smallest, with each role's per-instance capacity the mean over every instance of the model
(a role change keeps the hardware); ties go to the split nearest the current one (an idle model keeps its split).

Limits, said plainly: the demand is what this coordinator routed and saw done (replicas each see their own
share); requests served locally on a decode instance (per-request disaggregation) count as prefill demand; the
KV transfer's time is not capacity of either pool.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from coordinator.instances import InstanceState
from coordinator.latency import Interval, LatencyBook, StepCosts

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Demand:
    """One model's work per second over the recent window."""

    prefill_tokens_s: float = 0.0  # prompt tokens to compute per second (cached tokens excluded)
    output_tokens_s: float = 0.0  # output tokens per second
    mean_context: float = 0.0  # mean context (prompt plus output) of a decoding sequence, in tokens


@dataclass(frozen=True, slots=True)
class Engine:
    """One instance as sizing sees it."""

    role: str  # "hybrid" | "prefill" | "decode"
    costs: StepCosts
    kv_tokens: int = 0  # tokens of KV it can hold (blocks x block size x DP ranks); 0 when unknown


@dataclass(frozen=True, slots=True)
class Limits:
    """Engine options the capacity depends on."""

    budget: int = 8192  # max_num_batched_tokens: prompt tokens one step computes at most
    max_seqs: int = 256  # max_num_seqs: the largest decode batch
    itl_s: float = 0.0  # decode batch bounded so that a step stays within this (0: not bounded)


@dataclass(frozen=True, slots=True)
class Sizing:
    """One model's utilisation and suggested split."""

    model: str
    aggregated: bool  # every instance hybrid: one pool, no split
    instances: int  # instances counted (both pools, or the aggregated pool)
    prefill_utilisation: float  # aggregated: the pool's time share on prefill
    decode_utilisation: float  # aggregated: the pool's time share on decode
    prefill: int  # instances serving prefill now (aggregated: 0)
    decode: int  # instances serving decode now (aggregated: 0)
    suggested_prefill: (
        int  # the split of `prefill + decode` that minimises the larger utilisation (aggregated: 0)
    )
    suggested_decode: int
    decode_batch: float  # sequences per decode instance the demand implies at the current split (inf: beyond)
    demand: Demand = Demand()  # what the figures were computed from

    @property
    def utilisation(self) -> float:
        """Aggregated: the pool's (sum of both shares); P/D: the larger of the two."""
        if self.aggregated:
            return self.prefill_utilisation + self.decode_utilisation
        return max(self.prefill_utilisation, self.decode_utilisation)


def prefill_capacity(costs: StepCosts, limits: Limits) -> float:
    """Prompt tokens per second one instance computes with full chunks (inf while its learned costs are zero)."""
    seconds = costs.step + costs.prefill * limits.budget
    return limits.budget / seconds if seconds > 0 else math.inf


def decode_batch_limit(engine: Engine, context: float, limits: Limits) -> int:
    """The largest decode batch the instance runs at `context` tokens per sequence."""
    batch = float(limits.max_seqs)
    if engine.kv_tokens > 0:
        batch = min(batch, engine.kv_tokens / max(context, 1.0))
    per_seq = engine.costs.decode + engine.costs.context * context
    if limits.itl_s > 0 and per_seq > 0:
        batch = min(batch, (limits.itl_s - engine.costs.step) / per_seq)
    return max(1, math.floor(batch + 1e-9))  # (0.15 - 0.1) / 0.002 is 24.999... in floating point


def decode_capacity(engine: Engine, context: float, limits: Limits) -> float:
    """Output tokens per second one instance generates at its largest batch (`decode_batch_limit`)."""
    batch = decode_batch_limit(engine, context, limits)
    seconds = engine.costs.step_s(batch, context)
    return batch / seconds if seconds > 0 else math.inf


def implied_batch(costs: StepCosts, tokens_s: float, context: float) -> float:
    """The smallest batch at which one instance generates `tokens_s` (inf when no batch does)."""
    if tokens_s <= 0:
        return 0.0
    per_seq = costs.decode + costs.context * context
    slack = 1.0 - tokens_s * per_seq
    return tokens_s * costs.step / slack if slack > 0 else math.inf


def _share(demand: float, capacity: float) -> float:
    if demand <= 0:
        return 0.0
    return demand / capacity if capacity > 0 else math.inf


def _mean_costs(engines: list[Engine]) -> StepCosts:
    n = len(engines)
    return StepCosts(
        sum(e.costs.step for e in engines) / n,
        sum(e.costs.prefill for e in engines) / n,
        sum(e.costs.decode for e in engines) / n,
        sum(e.costs.context for e in engines) / n,
    )


def best_split(total: int, prefill_each: float, decode_each: float, demand: Demand, current: int) -> int:
    """Prefill instances among `total` (1 to total - 1) minimising the larger utilisation; ties nearest
    `current`."""

    def score(p: int) -> tuple[float, int]:
        worst = max(
            _share(demand.prefill_tokens_s, p * prefill_each),
            _share(demand.output_tokens_s, (total - p) * decode_each),
        )
        return (worst, abs(p - current))

    return min(range(1, total), key=score)


def size(model: str, demand: Demand, engines: Iterable[Engine], limits: Limits = Limits()) -> Sizing:
    """The model's utilisation per role and suggested split (see the module docstring)."""
    engines = list(engines)
    ctx = demand.mean_context
    if not engines or all(e.role == "hybrid" for e in engines):
        p_cap = sum(prefill_capacity(e.costs, limits) for e in engines)
        d_cap = sum(decode_capacity(e, ctx, limits) for e in engines)
        return Sizing(
            model,
            True,
            len(engines),
            _share(demand.prefill_tokens_s, p_cap),
            _share(demand.output_tokens_s, d_cap),
            0,
            0,
            0,
            0,
            0.0,
            demand,
        )
    pre = [e for e in engines if e.role == "prefill"]
    dec = [e for e in engines if e.role == "decode"]
    total = len(pre) + len(dec)
    u_p = _share(demand.prefill_tokens_s, sum(prefill_capacity(e.costs, limits) for e in pre))
    u_d = _share(demand.output_tokens_s, sum(decode_capacity(e, ctx, limits) for e in dec))
    batch = implied_batch(_mean_costs(dec), demand.output_tokens_s / len(dec), ctx) if dec else math.inf
    if total < 2:  # nothing to divide
        return Sizing(model, False, total, u_p, u_d, len(pre), len(dec), len(pre), len(dec), batch, demand)
    both = pre + dec
    prefill_each = sum(prefill_capacity(e.costs, limits) for e in both) / total
    decode_each = sum(decode_capacity(e, ctx, limits) for e in both) / total
    p = best_split(total, prefill_each, decode_each, demand, min(max(len(pre), 1), total - 1))
    return Sizing(model, False, total, u_p, u_d, len(pre), len(dec), p, total - p, batch, demand)


class DemandMeter:
    """Each model's demand over the last `window_s`, from its instances' progress reports.

    `observe` takes one report of one instance: what it did since its previous report (`Interval`, from
    `WorkloadLedger.engine_progress`) and the prefill tokens the ledger holds queued for it now. Arrived prefill
    is computed plus the queue's growth since the instance's previous report."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.clock = clock
        #: model -> (time, prefill tokens arrived, tokens generated, generated x context) per report
        self._events: dict[str, collections.deque[tuple[float, float, int, float]]] = {}
        self._since: dict[str, float] = {}  # model -> its first report
        self._queued: dict[str, int] = {}  # instance -> queued prefill at its previous report

    def observe(self, model: str, instance_id: str, done: Interval | None, queued_prefill: int) -> None:
        now = self.clock()
        before = self._queued.get(instance_id, 0)
        self._queued[instance_id] = queued_prefill
        computed = done.prefill_tokens if done is not None else 0
        generated = done.generated if done is not None else 0
        context = done.mean_context if done is not None else 0.0
        arrived = computed + queued_prefill - before
        if not arrived and not generated:
            self._prune(model, now)
            return
        self._since.setdefault(
            model, now - (done.seconds if done is not None else 0.0)
        )  # the interval's start
        self._events.setdefault(model, collections.deque()).append(
            (now, arrived, generated, generated * context)
        )
        self._prune(model, now)

    def forget(self, instance_id: str) -> None:
        """The instance is gone: its queue's next value is a new baseline."""
        self._queued.pop(instance_id, None)

    def _prune(self, model: str, now: float) -> None:
        events = self._events.get(model)
        while events and events[0][0] < now - self.window_s:
            events.popleft()

    def demand(self, model: str) -> Demand:
        """Work per second over the window (or since the model's first report, at least a tenth of the window);
        zero when nothing happened in the window."""
        now = self.clock()
        self._prune(model, now)
        events = self._events.get(model)
        if not events:
            return Demand()
        span = min(self.window_s, max(now - self._since[model], self.window_s / 10))
        arrived = sum(e[1] for e in events)
        generated = sum(e[2] for e in events)
        weighted = sum(e[3] for e in events)
        return Demand(max(0.0, arrived / span), generated / span, weighted / generated if generated else 0.0)

    def models(self) -> list[str]:
        return sorted(self._events)


def engines_of(states: Iterable[InstanceState], book: LatencyBook) -> dict[str, list[Engine]]:
    """Each model's instances that may serve (healthy, not drained), with their learned costs and KV size."""
    out: dict[str, list[Engine]] = {}
    for s in states:
        if not s.routable:
            continue
        info = s.info
        kv = s.load.kv_blocks * info.block_size * max(1, info.data_parallel_size)
        out.setdefault(info.model, []).append(Engine(info.role, book.costs(info.instance_id), kv))
    return out


def fleet_sizing(
    states: Iterable[InstanceState], book: LatencyBook, meter: DemandMeter, limits: Limits
) -> list[Sizing]:
    """Every model with a serving instance, by name: its utilisation and suggested split now."""
    by_model = engines_of(states, book)
    limits = Limits(book.budget, limits.max_seqs, limits.itl_s)
    return [size(m, meter.demand(m), by_model[m], limits) for m in sorted(by_model)]
