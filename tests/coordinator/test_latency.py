"""The latency model: step costs learned from progress intervals, and the TTFT/TPOT it predicts."""

from __future__ import annotations

import random

import pytest

from coordinator.latency import (
    DEFAULT_PRIOR,
    Interval,
    LatencyBook,
    StepCosts,
    StepLearner,
    merge,
    tpot_s,
    ttft_s,
)
from coordinator.workload import WorkloadLedger

TRUE = StepCosts(step=0.02, prefill=2.0e-4, decode=5.0e-5, context=2.0e-7)


def interval(rng: random.Random, costs: StepCosts = TRUE, noise: float = 0.0) -> Interval:
    """A busy interval as an engine with `costs` would produce it (decode steps with some prefill)."""
    decoding = rng.randint(1, 64)
    steps = rng.randint(5, 40)
    prefill = rng.choice([0, rng.randint(100, 6000)])
    context = rng.uniform(200, 4000)
    generated = steps * decoding
    seconds = (
        costs.step * steps
        + costs.prefill * prefill
        + costs.decode * generated
        + costs.context * generated * context
    )
    return Interval(seconds * (1 + rng.uniform(-noise, noise)), prefill, generated, decoding, context)


def test_the_learner_finds_an_engines_costs_from_its_intervals():
    rng = random.Random(1)
    learner = StepLearner(prior=DEFAULT_PRIOR, budget=8192)
    for _ in range(300):
        learner.observe(interval(rng, noise=0.05))
    learned = learner.costs
    assert learned.prefill == pytest.approx(TRUE.prefill, rel=0.1)
    assert learned.step == pytest.approx(TRUE.step, rel=0.2)
    assert learned.context == pytest.approx(TRUE.context, rel=0.25)


def test_terms_the_traffic_does_not_exercise_stay_at_the_prior():
    learner = StepLearner(prior=DEFAULT_PRIOR)
    for _ in range(100):  # prefill only: nothing decodes
        learner.observe(Interval(0.5, 2400, 0, 0))
    assert learner.costs.context == pytest.approx(DEFAULT_PRIOR.context, rel=0.01)
    assert learner.costs.prefill > DEFAULT_PRIOR.prefill  # 0.5 s for 2,400 tokens: slower than the prior


def test_old_intervals_fade_so_a_slower_engine_is_learned_anew():
    rng = random.Random(2)
    learner = StepLearner(forgetting=0.98)  # ~50 windows remembered, against a prior worth 4
    for _ in range(200):
        learner.observe(interval(rng))
    slower = StepCosts(TRUE.step * 2, TRUE.prefill * 2, TRUE.decode * 2, TRUE.context * 2)
    for _ in range(200):
        learner.observe(interval(rng, slower))
    assert learner.costs.prefill == pytest.approx(slower.prefill, rel=0.1)


def test_empty_or_instant_intervals_teach_nothing():
    learner = StepLearner()
    learner.observe(Interval(0.0, 100, 10, 1))
    learner.observe(Interval(0.3, 0, 0, 0))
    assert learner.observed == 0 and learner.costs == DEFAULT_PRIOR


def test_the_book_learns_only_from_busy_windows_of_at_least_window_s():
    book = LatencyBook(window_s=1.0)
    sample = Interval(0.25, 1000, 20, 4, 500.0)
    for _ in range(3):
        book.observe("i1", sample, busy=True)
    assert book.observed("i1") == 0  # 0.75 s so far
    book.observe("i1", None, busy=True)  # a restart: no interval
    book.observe("i1", sample, busy=False)  # idle: the partial window is dropped
    for _ in range(4):
        book.observe("i1", sample, busy=True)
    assert book.observed("i1") == 1
    assert book.costs("i2") == book.prior
    book.forget("i1")
    assert book.observed("i1") == 0


def test_merging_intervals_sums_work_and_weighs_batch_by_time():
    merged = merge([Interval(1.0, 100, 10, 2, 100.0), Interval(3.0, 0, 30, 6, 300.0)])
    assert (merged.seconds, merged.prefill_tokens, merged.generated) == (4.0, 100, 40)
    assert merged.decoding == pytest.approx(5.0)
    assert merged.mean_context == pytest.approx(250.0)


def test_ttft_counts_the_queue_ahead_and_the_steps_it_takes():
    costs = StepCosts(step=0.01, prefill=1e-4, decode=1e-3, context=0.0)
    alone = ttft_s(costs, 0, 1000, 0, 0.0, 8192)
    assert alone == pytest.approx(0.01 + 0.1)
    queued = ttft_s(costs, 9000, 1000, 10, 0.0, 8192)  # 10,000 tokens: two steps of 8,182
    assert queued == pytest.approx(1.0 + 2 * (0.01 + 0.01))


def test_tpot_is_one_step_of_a_batch_one_larger():
    costs = StepCosts(step=0.01, prefill=1e-4, decode=1e-3, context=1e-6)
    assert tpot_s(costs, 3, 1000.0, 2000) == pytest.approx(0.01 + 4e-3 + 1e-6 * 4 * 1250.0)


def test_bad_costs_are_named():
    assert StepCosts(0.01, 0.0, 0.0, 0.0).check() == "prefill: must be > 0 (a token of prefill takes time)"
    assert StepCosts(-1.0, 1e-4, 0.0, 0.0).check() == "step: must be >= 0, got -1.0"
    with pytest.raises(ValueError, match="forgetting"):
        StepLearner(forgetting=0.0)


def test_the_ledger_reports_what_an_instance_did_between_reports():
    now = [0.0]
    ledger = WorkloadLedger(clock=lambda: now[0])
    assert ledger.engine_progress("i1", {0: (0, 0)}) is None  # first report: baseline
    a = ledger.commit("i1", 600, 10, 1010, prompt_tokens=1000)  # 400 of 1,000 prompt tokens cached
    ledger.commit("i1", 500, 10, 510, prompt_tokens=500)
    now[0] = 0.25
    done = ledger.engine_progress("i1", {0: (1000, 1)})  # the first leg's prefill done, its first token
    assert done == Interval(0.25, 600, 0, 0.5, 1001.0)
    now[0] = 0.5
    done = ledger.engine_progress("i1", {0: (1000, 5)})
    assert (done.prefill_tokens, done.generated, done.decoding) == (0, 4, 1)
    assert ledger.decoding("i1") == (1, 1005.0)
    ledger.release(a)
    now[0] = 0.75
    assert ledger.engine_progress("i1", {0: (0, 0)}) is None  # counters went down: the engine restarted


def test_the_book_follows_each_instances_prefill_rate_busy_or_not():
    book = LatencyBook()
    for _ in range(40):  # 20 s at 4000 prompt tokens a second
        book.observe("a", Interval(0.5, 2000, 10, 4, 100.0), busy=True)
    assert book.prefill_rate("a") == pytest.approx(4000, rel=0.01)
    for _ in range(20):  # 10 s without prompts (idle reports count too): it decays within a few seconds
        book.observe("a", Interval(0.5, 0, 0, 0, 0.0), busy=False)
    assert book.prefill_rate("a") < 40
    assert book.prefill_rate("never") == 0.0
    book.forget("a")
    assert book.prefill_rate("a") == 0.0
