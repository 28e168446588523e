"""The admission queue's pure core: fairness, strict priority and displacement, TTL, bounds, retry-after."""

from __future__ import annotations

import pytest

from coordinator.flow_control import (
    DISPLACED,
    EXPIRED,
    LATE,
    SATURATED,
    EngineView,
    Entry,
    FlowQueue,
    TierSlo,
    Verdict,
    meeting,
    predict,
    thresholds,
)
from coordinator.latency import StepCosts
from coordinator.tenants import Tier

P, D, F = Tier.PRIORITY, Tier.DEFAULT, Tier.FLEX


def slos(max_queued: int = 100, ttl: float = 10.0) -> dict[Tier, TierSlo]:
    return {
        P: TierSlo(1.0, 0.1, max_queued, ttl, admit_on_expiry=True),
        D: TierSlo(2.0, 0.05, max_queued, ttl),
        F: TierSlo(10.0, 0.3, max_queued, ttl),
    }


def entry(tier: Tier = F, tenant: str = "a", tokens: int = 100) -> Entry:
    return Entry(object(), tier, tenant, tokens, 0.0)


def drain(q: FlowQueue, now: float = 1.0) -> list[Entry]:
    out = []
    while (head := q.head()) is not None:
        q.release(head, now)
        out.append(head)
    return out


def test_thresholds_are_the_tightest_of_the_tier_and_those_above():
    t = thresholds(slos())
    assert t[P] == (1.0, 0.1)
    assert t[D] == (1.0, 0.05)  # its own TPOT is tighter than priority's
    assert t[F] == (1.0, 0.05)  # flex never admits past what priority or default need
    assert meeting([(3.0, 0.01), (0.5, 0.04)], t[F])
    assert not meeting([(3.0, 0.01), (0.5, 0.06)], t[F])
    assert not meeting([], t[F])
    assert meeting([(3.0, 0.01), (0.5, 0.04), (0.9, 0.01)], t[F]) == [
        1,
        2,
    ]  # where an admitted request may go


def test_headroom_keeps_part_of_the_higher_tiers_slos_free_of_lower_tiers_work():
    t = thresholds(slos(), headroom=0.5, tpot_headroom=0.8)
    assert t[P] == (1.0, 0.1)  # the top tier may use all of its SLO
    assert t[D][0] == 0.5 and t[F][0] == 0.5  # the others stop at half of priority's TTFT
    assert t[D][1] == 0.05  # its own TPOT is tighter than 0.8 of priority's
    assert t[F][1] == pytest.approx(0.04)  # 0.8 of default's, the tightest above it
    assert FlowQueue(slos()).thresholds == t  # the defaults (DEFAULT_HEADROOM, DEFAULT_TPOT_HEADROOM)
    assert FlowQueue(slos(), headroom=1.0, tpot_headroom=1.0).threshold(F) == (1.0, 0.05)


def test_admits_at_once_when_it_fits_and_nothing_waits_ahead():
    q = FlowQueue(slos())
    assert q.offer(entry(F), fits=True, now=0).verdict == Verdict.ADMIT
    held = entry(F)
    assert q.offer(held, fits=False, now=0).verdict == Verdict.HOLD
    # A flex request that fits still waits behind the queued flex one (no overtaking)...
    assert q.offer(entry(F), fits=True, now=0).verdict == Verdict.HOLD
    # ...but a priority one does not wait behind flex.
    assert q.offer(entry(P), fits=True, now=0).verdict == Verdict.ADMIT
    assert q.depth(F) == 2 and len(q) == 2


def test_strict_priority_across_tiers():
    q = FlowQueue(slos())
    flex = [entry(F) for _ in range(3)]
    for e in flex:
        q.offer(e, fits=False, now=0)
    default = entry(D)
    q.offer(default, fits=False, now=1)
    prio = entry(P)
    q.offer(prio, fits=False, now=2)
    assert drain(q) == [prio, default, *flex]


def test_drr_shares_tokens_fairly_across_tenants():
    q = FlowQueue(slos(max_queued=1000), max_queued_total=1000, quantum_tokens=100)
    # Tenant "big" queues 20 requests of 1000 tokens first, "small" then 20 of 100 tokens.
    for _ in range(20):
        q.offer(entry(F, "big", 1000), fits=False, now=0)
    for _ in range(20):
        q.offer(entry(F, "small", 100), fits=False, now=0)
    order = drain(q)
    # While both are backlogged, tokens go evenly: after the first 2 big ones, small has had ~2000 tokens too.
    first = order[:22]
    big = sum(e.tokens for e in first if e.tenant == "big")
    small = sum(e.tokens for e in first if e.tenant == "small")
    assert big <= 2000 and small >= 1800
    # FIFO within a tenant.
    assert len(order) == 40


def test_drr_many_small_requests_cannot_starve_a_large_one():
    q = FlowQueue(slos(max_queued=1000), max_queued_total=1000, quantum_tokens=50)
    large = entry(F, "large", 5000)
    q.offer(large, fits=False, now=0)
    for _ in range(500):
        q.offer(entry(F, "chatty", 10), fits=False, now=0)
    order = drain(q)
    assert order.index(large) <= 501 - 1
    # The large request goes once its tenant's credit covers it: after about as many tokens of the chatty one.
    assert sum(e.tokens for e in order[: order.index(large)]) <= 5000 + 50


def test_bound_refuses_with_saturated_and_a_retry_after():
    q = FlowQueue(slos(max_queued=2))
    q.offer(entry(F), fits=False, now=0)
    q.offer(entry(F), fits=False, now=0)
    d = q.offer(entry(F, "b"), fits=False, now=0)
    assert d.verdict == Verdict.REJECT and d.reason == SATURATED
    assert d.retry_after_s == 10.0  # no drain rate measured yet: the tier's TTL
    assert q.counters.shed[("flex", "b", SATURATED)] == 1


def test_priority_displaces_the_newest_lower_tier_request_when_the_queue_is_full():
    q = FlowQueue(slos(), max_queued_total=3)
    default = entry(D)
    old_flex, new_flex = entry(F), entry(F)
    q.offer(default, fits=False, now=0)
    q.offer(old_flex, fits=False, now=1)
    q.offer(new_flex, fits=False, now=2)
    prio = entry(P)
    d = q.offer(prio, fits=False, now=3)
    assert d.verdict == Verdict.HOLD and d.displaced is new_flex
    assert q.counters.shed[("flex", "a", DISPLACED)] == 1
    d2 = q.offer(entry(P), fits=False, now=4)
    assert d2.displaced is old_flex
    d3 = q.offer(entry(P), fits=False, now=5)
    assert d3.displaced is default
    # Nothing lower left: a further priority request is refused; a flex one too.
    assert q.offer(entry(P), fits=False, now=6).reason == SATURATED
    assert q.offer(entry(F), fits=False, now=6).reason == SATURATED
    assert q.depth(P) == 3 and q.depth(F) == 0


def test_ttl_refuses_flex_and_admits_priority():
    q = FlowQueue(slos(ttl=5.0))
    flex, prio = entry(F), entry(P)
    q.offer(flex, fits=False, now=0)
    q.offer(prio, fits=False, now=0)
    assert flex.deadline == 5.0
    d = q.expire(flex)
    assert d.verdict == Verdict.REJECT and d.reason == EXPIRED
    assert q.expire(prio).verdict == Verdict.ADMIT
    assert len(q) == 0
    assert q.counters.shed == {("flex", "a", EXPIRED): 1}


def test_retry_after_from_the_drain_rate():
    q = FlowQueue(slos(max_queued=1000), max_queued_total=1000)
    for _ in range(40):
        q.offer(entry(F, tokens=1000), fits=False, now=0)
    now = 0.0
    for _ in range(20):  # 1000 tokens every 0.1 s: 10k tokens/s
        now += 0.1
        q.release(q.head(), now)
    assert q.drain_rate == pytest.approx(10_000, rel=0.05)
    # 20 waiting of 1000 tokens plus its own: ~2.1 s.
    assert q.retry_after_s(F, 1000) == pytest.approx(2.1, rel=0.1)
    # A priority request does not wait for flex work: the floor.
    assert q.retry_after_s(P, 100) == 1.0


def test_a_request_that_would_start_after_its_ttft_slo_is_refused_at_arrival():
    def draining(ttft_slo_s: float = 10.0, **flex) -> FlowQueue:
        """A queue releasing 10k tokens a second with 11 waiting flex requests of 10k tokens (an 11 s wait)."""
        tiers = {**slos(max_queued=1000), F: TierSlo(ttft_slo_s, 0.3, 1000, 60.0, **flex)}
        q = FlowQueue(tiers, max_queued_total=1000)  # flex's threshold: half priority's 1 s TTFT SLO
        assert q.wait_s(F) is None  # no rate before the first release: nothing is late
        for _ in range(31):
            q.offer(entry(F, tokens=10_000), fits=False, now=0)
        for step in range(1, 21):
            q.release(q.head(), step)
        assert q.drain_rate == pytest.approx(10_000)
        return q

    q = draining()
    d = q.offer(entry(F, "b"), fits=False, now=20)
    assert d.verdict == Verdict.REJECT and d.reason == LATE
    assert d.retry_after_s == pytest.approx(11.01)  # with its own 100 tokens
    assert q.counters.shed == {("flex", "b", LATE): 1} and q.depth(F) == 11
    # The wait (11 s) plus the most an engine may take once released (0.5 s) is what must fit in the SLO.
    assert draining(11.4).offer(entry(F), fits=False, now=20).reason == LATE
    assert draining(11.6).offer(entry(F), fits=False, now=20).verdict == Verdict.HOLD
    # A tier above waits for its own tier and above only; priority (admitted past its TTL) is never late.
    assert q.offer(entry(D), fits=False, now=20).verdict == Verdict.HOLD
    for _ in range(200):
        q.offer(entry(P, tokens=10_000), fits=False, now=20)
    assert q.offer(entry(P), fits=False, now=20).verdict == Verdict.HOLD
    # Fitting with nothing waiting ahead is admitted, whatever the queue below holds.
    assert draining().offer(entry(P), fits=True, now=20).verdict == Verdict.ADMIT
    # `refuse_late: false`: it waits, up to the TTL.
    assert draining(refuse_late=False).offer(entry(F), fits=False, now=20).verdict == Verdict.HOLD


def test_remove_frees_everything():
    q = FlowQueue(slos())
    entries = [entry(t, tenant) for t in (P, D, F) for tenant in ("a", "b")]
    for e in entries:
        q.offer(e, fits=False, now=0)
    q.head()
    for e in entries:
        assert q.remove(e)
        assert not q.remove(e)
    assert len(q) == 0 and q.head() is None
    assert all(q.depth(t) == 0 and not q.depth_by_tenant(t) for t in (P, D, F))
    assert q.retry_after_s(F) == 10.0


def test_predictions_take_the_engines_own_report_when_it_says_more():
    costs = StepCosts(step=0.01, prefill=1e-4, decode=1e-3, context=0.0)
    mine = EngineView(costs, queued_prefill=1000, decoding=2, mean_context=0.0, in_flight=3)
    ttft, tpot = predict(mine, 500, 8192)
    assert ttft == pytest.approx(1e-4 * 1500 + 0.01 + 2e-3) and tpot == pytest.approx(0.01 + 3e-3)
    # Another replica's requests show only in the engine's report: 10 waiting of this size, 20 running.
    shared = EngineView(costs, 1000, 2, 0.0, 3, running=20, waiting=10)
    ttft, tpot = predict(shared, 500, 8192)
    assert ttft == pytest.approx(1e-4 * 5500 + 0.01 + 20e-3) and tpot == pytest.approx(0.01 + 21e-3)
    assert not mine.idle and EngineView(costs, 0, 0, 0.0, 0).idle
    assert not EngineView(costs, 0, 0, 0.0, 0, running=1).idle


def test_the_tpot_counts_the_engines_prefill_duty_cycle():
    costs = StepCosts(step=0.01, prefill=1e-4, decode=0.0, context=0.0)
    quiet = EngineView(costs, 0, 4, 0.0, 4)
    busy = EngineView(costs, 0, 4, 0.0, 4, prefill_rate=5000)  # half of each second computing prompts
    assert predict(quiet, 100, 8192)[1] == pytest.approx(0.01)
    assert predict(busy, 100, 8192)[1] == pytest.approx(0.02)
    saturated = EngineView(costs, 0, 4, 0.0, 4, prefill_rate=1e6)
    assert predict(saturated, 100, 8192)[1] == pytest.approx(0.01 / 0.05)  # bounded
