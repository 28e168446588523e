"""P:D sizing: utilisation per role from demand and learned step costs, and the suggested split (hand-computed)."""

from __future__ import annotations

import math

import pytest

from coordinator.capacity import (
    Demand,
    DemandMeter,
    Engine,
    Limits,
    best_split,
    decode_batch_limit,
    decode_capacity,
    implied_batch,
    prefill_capacity,
    size,
)
from coordinator.latency import Interval, StepCosts

# 0.1 s a step, 0.1 ms a prompt token, 1 ms a decoding sequence, 1 us a context token: with 1,000-token chunks a
# prefill step takes 0.1 + 0.1 = 0.2 s (5,000 tokens/s); 100 sequences of 1,000 tokens take
# 0.1 + 100 * (0.001 + 0.001) = 0.3 s a step (333.3 tokens/s).
COSTS = StepCosts(step=0.1, prefill=1e-4, decode=1e-3, context=1e-6)
LIMITS = Limits(budget=1000, max_seqs=100)


def engines(prefill: int, decode: int, role_hybrid: int = 0) -> list[Engine]:
    return (
        [Engine("prefill", COSTS)] * prefill
        + [Engine("decode", COSTS)] * decode
        + [Engine("hybrid", COSTS)] * role_hybrid
    )


def test_capacities_per_instance():
    assert prefill_capacity(COSTS, LIMITS) == pytest.approx(5000)
    assert decode_capacity(Engine("decode", COSTS), 1000, LIMITS) == pytest.approx(100 / 0.3)


def test_zero_learned_costs_read_as_unbounded_capacity_not_an_error():
    # A fit that has learned nothing yet (every cost zero) must not break /metrics: no capacity bound, utilisation 0.
    zero = StepCosts(step=0.0, prefill=0.0, decode=0.0, context=0.0)
    assert prefill_capacity(zero, LIMITS) == math.inf
    assert decode_capacity(Engine("decode", zero), 1000, LIMITS) == math.inf
    busy = Demand(prefill_tokens_s=1000, output_tokens_s=100, mean_context=1000)
    sized = size("m", busy, [Engine("prefill", zero), Engine("decode", zero)], LIMITS)
    assert (sized.prefill_utilisation, sized.decode_utilisation) == (0, 0)


def test_the_decode_batch_is_bounded_by_kv_blocks_and_by_the_itl_target():
    # 50,000 tokens of KV hold 50 sequences of 1,000: 50 / (0.1 + 50 * 0.002) = 250 tokens/s
    small = Engine("decode", COSTS, kv_tokens=50_000)
    assert decode_batch_limit(small, 1000, LIMITS) == 50
    assert decode_capacity(small, 1000, LIMITS) == pytest.approx(250)
    # a 150 ms step allows (0.15 - 0.1) / 0.002 = 25 sequences
    assert decode_batch_limit(Engine("decode", COSTS), 1000, Limits(1000, 100, itl_s=0.15)) == 25
    # an unreachable target still leaves one sequence
    assert decode_batch_limit(Engine("decode", COSTS), 1000, Limits(1000, 100, itl_s=0.05)) == 1


def test_the_batch_the_demand_implies():
    # 166.7 tokens/s per instance: B / (0.1 + 0.002 B) = 166.7 -> B = 16.67 / (1 - 0.333) = 25
    assert implied_batch(COSTS, 500 / 3, 1000) == pytest.approx(25)
    assert implied_batch(COSTS, 0, 1000) == 0
    assert implied_batch(COSTS, 600, 1000) == math.inf  # beyond 1 / 0.002 = 500 tokens/s at any batch


def test_pd_utilisation_and_suggested_split():
    # 3P+3D: prefill 15,000 / (3 x 5,000) = 1.0, decode 500 / (3 x 333.3) = 0.5
    # 4P+2D: 0.75 and 0.75 (the best); 5P+1D: 0.6 and 1.5
    demand = Demand(prefill_tokens_s=15_000, output_tokens_s=500, mean_context=1000)
    s = size("m", demand, engines(3, 3), LIMITS)
    assert not s.aggregated
    assert (s.prefill, s.decode) == (3, 3)
    assert s.prefill_utilisation == pytest.approx(1.0)
    assert s.decode_utilisation == pytest.approx(0.5)
    assert s.utilisation == pytest.approx(1.0)
    assert (s.suggested_prefill, s.suggested_decode) == (4, 2)
    assert s.decode_batch == pytest.approx(25)


def test_decode_heavy_demand_moves_instances_to_decode():
    # 2,000 tokens/s of prompts, 1,500 of output on 6: P=1 -> 0.4 and 1500 / 1666.7 = 0.9 (the best);
    # P=2 -> 0.2 and 1500 / 1333.3 = 1.125
    demand = Demand(prefill_tokens_s=2000, output_tokens_s=1500, mean_context=1000)
    s = size("m", demand, engines(3, 3), LIMITS)
    assert (s.suggested_prefill, s.suggested_decode) == (1, 5)


def test_an_idle_model_reads_zero_and_keeps_its_split():
    s = size("m", Demand(), engines(2, 6), LIMITS)
    assert (s.prefill_utilisation, s.decode_utilisation) == (0, 0)
    assert (s.suggested_prefill, s.suggested_decode) == (2, 6)


def test_a_role_with_demand_and_no_instance_is_infinitely_used():
    s = size("m", Demand(1000, 100, 500), engines(0, 2), LIMITS)
    assert s.prefill_utilisation == math.inf
    assert (s.suggested_prefill, s.suggested_decode) == (1, 1)


def test_ties_go_to_the_split_nearest_the_current_one():
    demand = Demand(prefill_tokens_s=0, output_tokens_s=0)
    assert best_split(8, 5000, 333, demand, current=5) == 5


def test_an_aggregated_pool_sums_both_shares_and_suggests_no_split():
    # 2 hybrid: prefill 5,000 / 10,000 = 0.5, decode 333.3 / 666.7 = 0.5
    s = size("m", Demand(5000, 1000 / 3, 1000), engines(0, 0, 2), LIMITS)
    assert s.aggregated
    assert s.prefill_utilisation == pytest.approx(0.5)
    assert s.decode_utilisation == pytest.approx(0.5)
    assert s.utilisation == pytest.approx(1.0)
    assert (s.suggested_prefill, s.suggested_decode) == (0, 0)


def test_hybrid_instances_of_a_pd_model_count_in_neither_pool():
    s = size("m", Demand(5000, 1000 / 3, 1000), engines(1, 1, 2), LIMITS)
    assert s.instances == 2
    assert s.prefill_utilisation == pytest.approx(1.0)
    assert s.decode_utilisation == pytest.approx(1.0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_meter_counts_arrived_prefill_as_computed_plus_queue_growth():
    clock = Clock()
    meter = DemandMeter(window_s=10, clock=clock)
    # 1,000 computed and 3,000 now queued: 4,000 arrived; then 2,000 computed and the queue down to 1,000: none
    meter.observe("m", "a", Interval(1.0, 1000, 200, 2, 500.0), queued_prefill=3000)
    clock.t = 5
    meter.observe("m", "a", Interval(5.0, 2000, 300, 3, 1000.0), queued_prefill=1000)
    clock.t = 10
    d = meter.demand("m")
    assert d.prefill_tokens_s == pytest.approx(400)
    assert d.output_tokens_s == pytest.approx(50)
    assert d.mean_context == pytest.approx((200 * 500 + 300 * 1000) / 500)
    clock.t = 12  # the first report left the window
    d = meter.demand("m")
    assert d.prefill_tokens_s == 0
    assert d.output_tokens_s == pytest.approx(30)
    assert d.mean_context == pytest.approx(1000)
    clock.t = 30
    assert meter.demand("m") == Demand()
    assert meter.demand("other") == Demand()


def test_a_young_model_is_measured_over_its_life_not_the_whole_window():
    clock = Clock()
    meter = DemandMeter(window_s=60, clock=clock)
    clock.t = 1
    meter.observe("m", "a", Interval(1.0, 6000, 0, 0), queued_prefill=0)  # its first interval began at 0
    clock.t = 12
    assert meter.demand("m").prefill_tokens_s == pytest.approx(500)
    clock.t = 3  # at least a tenth of the window
    assert meter.demand("m").prefill_tokens_s == pytest.approx(1000)
