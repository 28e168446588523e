"""SLO-aware admission (flow control), pure core: whether a request goes to an engine now, waits in the
coordinator, or is refused, and in which order waiting requests go.

(Not `coordinator/admission.py`, which admits engine *registrations*.)

**When a request waits.** Each tier has an SLO (`TierSlo`: time to first token, time per output token). A request
is admitted at once when some candidate engine's predicted TTFT and TPOT (`coordinator/latency.py`) meet its
tier's *threshold* and nothing of its tier or above is already waiting (no overtaking). The threshold of a tier is
the tightest SLO of that tier and every tier above it (`thresholds`), those of the tiers above scaled by the
*headroom* (`DEFAULT_HEADROOM`, 0.5, of their TTFT; `DEFAULT_TPOT_HEADROOM`, 0.8, of their TPOT): admitting `flex`
work never pushes the fleet past what `priority` requests need, and stops while half of their TTFT SLO is still
free, so a `priority` request arriving during a burst finds room at once instead of waiting behind lower tiers' work
admitted just before it; and while a fifth of their TPOT is, so the prompts of lower tiers' requests admitted last
do not slow the decoding `priority` requests past theirs. A tier's own, looser SLO only says how long its requests
may be expected to take. Otherwise the request waits in its tier's queue. Admitted, it goes to one of the
candidates that meet its threshold (`meeting`; the routing policy chooses among them): on a mixed fleet a slower
engine that would miss it is left to the tiers whose SLOs it still meets.

**Order.** Strict priority across tiers (`priority`, then `default`, then `flex`); within a tier, deficit round
robin across tenants on tokens (prompt plus `max_tokens`, the quota's estimate): each turn, a tenant with waiting
requests gets `quantum_tokens` more credit and sends its head request once its credit covers the request's tokens,
so a tenant with many or large requests cannot starve one with few or small ones, and in the long run each
backlogged tenant gets an equal share of tokens.

**Late requests are refused at once.** A request that would wait (tier `refuse_late`, the default of every tier
without `admit_on_expiry`) is refused at arrival (`late`) when its predicted wait plus its tier's TTFT threshold
(the most an engine it is released to may take to its first token) exceeds its tier's TTFT SLO. The wait is the
tokens waiting at its tier and above, drained at the rate tokens have been released from the queue lately
(`drain_rate`). It could not meet its SLO, and served late it would take capacity from requests that still can;
its client learns it at once instead of after the TTL, with a `retry-after` of that wait. Before the first
release there is no rate, and nothing is refused as late.

**Bounds.** A tier holds at most `max_queued` requests and all tiers together `max_queued_total`. An arrival
finding its tier full is refused (429 `rejected: saturated`). An arrival finding the total full displaces the
newest request of the lowest tier below its own (that one is refused, reason `displaced`), or is refused if there
is none. A request waiting past its tier's `queue_ttl_s` is refused (`expired`), or, for a tier with
`admit_on_expiry` (`priority` by default), sent to the engines anyway, where the engines' own priority queue serves
it first.

**Retry-after.** A refusal's `retry_after_s` is the predicted time to drain the tokens waiting at the request's
tier and above, at the rate tokens have been released from the queue lately (`drain_rate`, exponentially
weighted); with no rate measured yet, the tier's TTL. Clamped to [1 s, `max_retry_after_s`].

Everything is a plain value; time is passed in. The shell (`coordinator/flow_shell.py`) holds the waiting
decisions as asyncio futures and calls `release` when capacity frees.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum

from coordinator.latency import StepCosts, tpot_s, ttft_s
from coordinator.tenants import TIER_RANK, Tier

#: Tiers from the one served first.
TIERS_BY_RANK: tuple[Tier, ...] = tuple(sorted(TIER_RANK, key=TIER_RANK.__getitem__, reverse=True))


@dataclass(frozen=True, slots=True)
class TierSlo:
    """One tier's SLO and queue."""

    ttft_slo_s: float  # predicted time to first token a request of the tier should see
    tpot_slo_s: float  # predicted time per output token
    max_queued: int  # requests of the tier waiting at once (0: never wait, refuse at once)
    queue_ttl_s: float  # longest a request of the tier waits
    admit_on_expiry: bool = False  # past the TTL: sent to an engine anyway (else refused)
    refuse_late: bool = True  # refused at arrival when it would start past its TTFT SLO (no admit_on_expiry)


#: Defaults (docs/scheduling.md): interactive `priority` wants its first token within a second, `default` within
#: two, `flex` (batch) within ten; a TPOT of 0.1 s is ~10 tokens/s a stream, reading speed.
DEFAULT_SLOS: dict[Tier, TierSlo] = {
    Tier.PRIORITY: TierSlo(1.0, 0.1, 256, 10.0, admit_on_expiry=True),
    Tier.DEFAULT: TierSlo(2.0, 0.15, 256, 10.0),
    Tier.FLEX: TierSlo(10.0, 0.3, 1024, 20.0),
}


#: The share of a higher tier's TTFT and TPOT SLOs a lower tier's admissions may fill (measured in
#: docs/scheduling.md).
DEFAULT_HEADROOM = 0.5
DEFAULT_TPOT_HEADROOM = 0.8


def thresholds(
    slos: dict[Tier, TierSlo], headroom: float = 1.0, tpot_headroom: float = 1.0
) -> dict[Tier, tuple[float, float]]:
    """Per tier, the (TTFT, TPOT) a candidate must meet for a request of it to be admitted: the tightest of its
    own SLO and those of the tiers above it, their TTFT scaled by `headroom` and their TPOT by `tpot_headroom` (1:
    none kept free)."""
    out: dict[Tier, tuple[float, float]] = {}
    ttft = tpot = math.inf  # the tightest of the tiers above, already scaled
    for tier in TIERS_BY_RANK:
        slo = slos[tier]
        out[tier] = (min(ttft, slo.ttft_slo_s), min(tpot, slo.tpot_slo_s))
        ttft = min(ttft, slo.ttft_slo_s * headroom)
        tpot = min(tpot, slo.tpot_slo_s * tpot_headroom)
    return out


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the coordinator knows of one candidate engine: its learned step costs, its own ledger's figures, and
    what the engine last reported (which includes the other coordinator replicas' requests)."""

    costs: StepCosts
    queued_prefill: int  # the ledger's prefill tokens not yet computed
    decoding: int  # the ledger's legs past their prefill
    mean_context: float  # their mean context
    in_flight: int  # the ledger's request legs
    running: int = 0  # the engine's report (vllm:num_requests_running)
    waiting: int = 0  # likewise (vllm:num_requests_waiting)
    prefill_rate: float = 0.0  # prompt tokens it computed a second lately (`LatencyBook.prefill_rate`)

    @property
    def idle(self) -> bool:
        return self.in_flight == 0 and self.running == 0 and self.waiting == 0


#: The largest prefill duty cycle `predict` counts (past it the TPOT would be unbounded; it is then well above any
#: SLO anyway).
MAX_PREFILL_DUTY = 0.95


def predict(view: EngineView, prompt_tokens: int, budget: int) -> tuple[float, float]:
    """A request's predicted (TTFT, TPOT) on the engine `view` describes: the ledger's queue and batch, each
    raised to the engine's report (its waiting requests taken as prompts of this request's size).

    The TPOT counts the prefill the engine keeps computing while the request decodes: with chunked prefill a step
    that carries a prompt chunk delays every decoding sequence, so of each second the engine spends
    `d = prefill cost x prompt tokens a second` on prefill, and decode steps get the rest:
    `tpot = step_s(batch + 1) / (1 - d)` (`latency.tpot_s` alone is the decode step)."""
    queued = max(view.queued_prefill, view.waiting * prompt_tokens)
    decoding = max(view.decoding, view.running)
    ttft = ttft_s(view.costs, queued, prompt_tokens, decoding, view.mean_context, budget)
    duty = min(MAX_PREFILL_DUTY, view.costs.prefill * view.prefill_rate)
    return ttft, tpot_s(view.costs, decoding, view.mean_context, prompt_tokens) / (1.0 - duty)


def meeting(predictions: list[tuple[float, float]], threshold: tuple[float, float]) -> list[int]:
    """The indices of the candidates whose predicted (TTFT, TPOT) meets `threshold`."""
    ttft, tpot = threshold
    return [i for i, (p_ttft, p_tpot) in enumerate(predictions) if p_ttft <= ttft and p_tpot <= tpot]


def engines_meeting(
    views: list[EngineView], prompt_tokens: int, budget: int, threshold: tuple[float, float]
) -> list[int] | None:
    """The indices of the engines predicted (`predict`) to meet `threshold` for a prompt of `prompt_tokens`; None
    when one has nothing in flight: it fits whatever the SLO (holding a request cannot make an idle engine
    faster), and any engine may take the request."""
    if any(v.idle for v in views):
        return None
    return meeting([predict(v, prompt_tokens, budget) for v in views], threshold)


def fits(met: Collection[object] | None) -> bool:
    """Whether a request may go now, given where it may go (`engines_meeting`, None: anywhere)."""
    return met is None or bool(met)


class Verdict(StrEnum):
    ADMIT = "admit"  # go to an engine now
    HOLD = "hold"  # wait in the queue
    REJECT = "reject"  # 429


#: Reasons a request is refused (the `reason` label of `tandem_coordinator_shed_total`).
SATURATED = "saturated"  # its tier's queue, or the whole queue, was full
EXPIRED = "expired"  # it waited past its tier's TTL
LATE = "late"  # its predicted wait and its tier's TTFT threshold exceeded its tier's TTFT SLO
DISPLACED = "displaced"  # a request of a higher tier took its place


@dataclass(slots=True, eq=False)
class Entry:
    """One waiting request."""

    key: object  # the shell's handle (compared by identity)
    tier: Tier
    tenant: str
    tokens: int  # prompt plus max_tokens
    queued_at: float
    deadline: float = 0.0
    queued: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    reason: str = ""  # for REJECT
    retry_after_s: float = 0.0  # for REJECT
    displaced: Entry | None = None  # HOLD that took the place of this (now refused) entry


@dataclass(slots=True)
class _TierQueue:
    """One tier: per-tenant FIFOs and the DRR state."""

    by_tenant: dict[str, deque[Entry]] = field(default_factory=dict)
    active: deque[str] = field(default_factory=deque)  # tenants with waiting requests, in turn order
    deficit: dict[str, int] = field(default_factory=dict)
    turn: bool = False  # the tenant at the front has had its quantum for this turn
    size: int = 0
    tokens: int = 0


@dataclass(slots=True)
class FlowCounters:
    """Since start, per (tier, tenant): admitted at once, queued, released from the queue, refused by reason;
    and the waits of released requests (their sum, for a mean)."""

    admitted: dict[tuple[str, str], int] = field(default_factory=dict)
    queued: dict[tuple[str, str], int] = field(default_factory=dict)
    released: dict[tuple[str, str], int] = field(default_factory=dict)
    shed: dict[tuple[str, str, str], int] = field(default_factory=dict)
    wait_s: dict[tuple[str, str], float] = field(default_factory=dict)

    def add(self, counts: dict, key: tuple, amount: float = 1) -> None:
        counts[key] = counts.get(key, 0) + amount


class FlowQueue:
    """The waiting requests of one model's engines (the shell keeps one per model: capacity is per model)."""

    def __init__(
        self,
        slos: dict[Tier, TierSlo] | None = None,
        max_queued_total: int = 1024,
        quantum_tokens: int = 2048,
        max_retry_after_s: float = 60.0,
        rate_halflife_s: float = 10.0,
        headroom: float = DEFAULT_HEADROOM,
        tpot_headroom: float = DEFAULT_TPOT_HEADROOM,
    ) -> None:
        self.slos = dict(slos or DEFAULT_SLOS)
        self.thresholds = thresholds(self.slos, headroom, tpot_headroom)
        self.max_queued_total = max_queued_total
        self.quantum = max(1, quantum_tokens)
        self.max_retry_after_s = max_retry_after_s
        self.rate_halflife_s = rate_halflife_s
        self.counters = FlowCounters()
        self._tiers = {tier: _TierQueue() for tier in TIERS_BY_RANK}
        self._rate = 0.0  # tokens/s released lately (0: none measured)
        self._rate_at: float | None = None
        self._pending = 0  # tokens released since `_rate_at`

    # --- readings ------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(q.size for q in self._tiers.values())

    def depth(self, tier: Tier) -> int:
        return self._tiers[tier].size

    def depth_by_tenant(self, tier: Tier) -> dict[str, int]:
        return {t: len(d) for t, d in self._tiers[tier].by_tenant.items() if d}

    def waiting_ahead(self, tier: Tier) -> int:
        """Requests waiting at `tier` or above."""
        return sum(self._tiers[t].size for t in TIERS_BY_RANK if TIER_RANK[t] >= TIER_RANK[tier])

    def threshold(self, tier: Tier) -> tuple[float, float]:
        return self.thresholds[tier]

    @property
    def drain_rate(self) -> float:
        """Tokens a second released from the queue lately (0 before any)."""
        return self._rate

    def wait_s(self, tier: Tier, extra_tokens: int = 0) -> float | None:
        """The predicted drain time of the tokens waiting at `tier` and above, plus `extra_tokens`, at the drain
        rate (None before any rate is measured)."""
        if self._rate <= 0:
            return None
        tokens = extra_tokens + sum(
            self._tiers[t].tokens for t in TIERS_BY_RANK if TIER_RANK[t] >= TIER_RANK[tier]
        )
        return tokens / self._rate

    def retry_after_s(self, tier: Tier, extra_tokens: int = 0) -> float:
        """`wait_s` with the request's own tokens, or the tier's TTL before any rate, clamped (see the module
        doc)."""
        wait = self.wait_s(tier, extra_tokens)
        wait = self.slos[tier].queue_ttl_s if wait is None else wait
        return min(self.max_retry_after_s, max(1.0, wait))

    # --- decisions ------------------------------------------------------------------------------------------

    def offer(self, entry: Entry, fits: bool, now: float) -> Decision:
        """A new request: admitted at once when `fits` (some candidate meets its tier's threshold) and nothing at
        its tier or above waits; else refused when its predicted wait and threshold exceed its tier's TTFT SLO
        (`refuse_late`); else held (its deadline set), displacing a lower tier's newest entry when the whole queue
        is full; else refused."""
        key = (entry.tier.value, entry.tenant)
        if fits and self.waiting_ahead(entry.tier) == 0:
            self.counters.add(self.counters.admitted, key)
            return Decision(Verdict.ADMIT)
        slo = self.slos[entry.tier]
        tier_q = self._tiers[entry.tier]
        displaced = None
        if slo.refuse_late and not slo.admit_on_expiry:
            wait = self.wait_s(entry.tier)
            if wait is not None and wait + self.thresholds[entry.tier][0] > slo.ttft_slo_s:
                return self._refuse(entry, LATE)
        if tier_q.size >= slo.max_queued:
            return self._refuse(entry, SATURATED)
        if len(self) >= self.max_queued_total:
            displaced = self._newest_below(entry.tier)
            if displaced is None:
                return self._refuse(entry, SATURATED)
            self.remove(displaced)
            self.counters.add(self.counters.shed, (displaced.tier.value, displaced.tenant, DISPLACED))
        entry.queued_at = now
        entry.deadline = now + slo.queue_ttl_s
        self._push(entry)
        self.counters.add(self.counters.queued, key)
        return Decision(Verdict.HOLD, displaced=displaced)

    def _refuse(self, entry: Entry, reason: str) -> Decision:
        self.counters.add(self.counters.shed, (entry.tier.value, entry.tenant, reason))
        return Decision(Verdict.REJECT, reason, self.retry_after_s(entry.tier, entry.tokens))

    def head(self) -> Entry | None:
        """The entry `release` would send next: the highest tier's DRR choice (advances DRR credit, idempotently:
        the same head until it leaves)."""
        for tier in TIERS_BY_RANK:
            q = self._tiers[tier]
            if q.size:
                return self._drr_head(q)
        return None

    def release(self, entry: Entry, now: float) -> None:
        """`entry` (the head) goes to an engine: it leaves the queue, its tokens charged to its tenant's credit."""
        q = self._tiers[entry.tier]
        if q.active and q.active[0] == entry.tenant:
            q.deficit[entry.tenant] = q.deficit.get(entry.tenant, 0) - entry.tokens
        self.remove(entry)
        key = (entry.tier.value, entry.tenant)
        self.counters.add(self.counters.released, key)
        self.counters.add(self.counters.wait_s, key, max(0.0, now - entry.queued_at))
        self._measure(entry.tokens, now)

    def expire(self, entry: Entry) -> Decision:
        """`entry` waited past its deadline: it leaves the queue, and is admitted (tier `admit_on_expiry`) or
        refused."""
        self.remove(entry)
        if self.slos[entry.tier].admit_on_expiry:
            self.counters.add(self.counters.admitted, (entry.tier.value, entry.tenant))
            return Decision(Verdict.ADMIT, EXPIRED)
        return self._refuse(entry, EXPIRED)

    def remove(self, entry: Entry) -> bool:
        """Takes `entry` out of the queue (released, expired, displaced, or its client left); True if it was in."""
        if not entry.queued:
            return False
        entry.queued = False
        q = self._tiers[entry.tier]
        fifo = q.by_tenant.get(entry.tenant)
        if fifo is None:
            return False
        for i, other in enumerate(fifo):
            if other is entry:
                del fifo[i]
                break
        q.size -= 1
        q.tokens -= entry.tokens
        if not fifo:
            del q.by_tenant[entry.tenant]
            q.deficit.pop(entry.tenant, None)
            if q.active and q.active[0] == entry.tenant:
                q.turn = False  # the next tenant's turn has not started
            try:
                q.active.remove(entry.tenant)
            except ValueError:
                pass
        return True

    # --- internals ------------------------------------------------------------------------------------------

    def _push(self, entry: Entry) -> None:
        q = self._tiers[entry.tier]
        fifo = q.by_tenant.get(entry.tenant)
        if fifo is None:
            fifo = q.by_tenant[entry.tenant] = deque()
            q.active.append(entry.tenant)
            q.deficit[entry.tenant] = 0
        fifo.append(entry)
        entry.queued = True
        q.size += 1
        q.tokens += entry.tokens

    def _drr_head(self, q: _TierQueue) -> Entry:
        # The tenant at the front starts its turn with one more quantum of credit and sends while its credit
        # covers its head; short, its turn ends and it goes to the back. Rounds in which no tenant could send are
        # skipped arithmetically (each would add a quantum to every tenant).
        while True:
            if not q.turn:
                rounds = min(
                    math.ceil((q.by_tenant[t][0].tokens - q.deficit[t]) / self.quantum) for t in q.active
                )
                if rounds > 1:
                    for t in q.active:
                        q.deficit[t] += (rounds - 1) * self.quantum
                q.deficit[q.active[0]] += self.quantum
                q.turn = True
            tenant = q.active[0]
            head = q.by_tenant[tenant][0]
            if q.deficit[tenant] >= head.tokens:
                return head
            q.active.rotate(-1)
            q.turn = False

    def _newest_below(self, tier: Tier) -> Entry | None:
        for lower in reversed(TIERS_BY_RANK):
            if TIER_RANK[lower] >= TIER_RANK[tier]:
                return None
            q = self._tiers[lower]
            if q.size:
                return max((fifo[-1] for fifo in q.by_tenant.values()), key=lambda e: e.queued_at)
        return None

    def _measure(self, tokens: int, now: float) -> None:
        if self._rate_at is None:
            self._rate_at = now  # the rate is measured from the first release on
            return
        dt = now - self._rate_at
        self._pending += tokens
        if dt < 0.05:  # too short an interval to divide by: accumulate
            return
        instant = self._pending / dt
        weight = 1.0 - 0.5 ** (dt / self.rate_halflife_s)
        self._rate = instant if self._rate == 0 else self._rate + weight * (instant - self._rate)
        self._rate_at = now
        self._pending = 0
