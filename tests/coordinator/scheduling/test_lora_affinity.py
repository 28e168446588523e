"""`lora_affinity`: adapters resident, free slots, cold-load cost, hysteresis, the adapter's own KV hits."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator.scheduling import create_policy
from coordinator.scheduling.lora_affinity import LoraAffinity, Params, slots
from tests.coordinator.scheduling.fakes import cand, facts


def with_lora(c, adapters=(), active=(), max_loras=4, at=0.0):
    load = c.state.load
    load.adapters, load.active_adapters, load.max_loras = frozenset(adapters), frozenset(active), max_loras
    load.sampled_at = at
    return c


def ask(adapter="a", isl=160):
    return replace(facts(isl), adapter=adapter)


def test_registered_with_its_parameters():
    p = create_policy("lora_affinity", {"spread_factor": 3, "load_weight": 1})
    assert isinstance(p, LoraAffinity) and p.params.spread_factor == 3 and p.kv.params.load_weight == 1
    with pytest.raises(ValueError, match="lora_affinity.spread_factor: must be >= 1"):
        create_policy("lora_affinity", {"spread_factor": 0.5})
    with pytest.raises(ValueError, match="lora_affinity.cold_load_s: must be >= 0"):
        create_policy("lora_affinity", {"cold_load_s": -1})


def test_slots_of_a_candidate():
    assert slots(with_lora(cand("x"), ["a"]), "a").resident
    assert slots(with_lora(cand("x"), ["b"]), "a").free
    full = with_lora(cand("x"), ["b", "c"], active=["b"], max_loras=2)
    assert not slots(full, "a").free and not slots(full, "a").blocked  # c is idle: it can be evicted
    blocked = with_lora(cand("x"), ["b", "c"], active=["b", "c"], max_loras=2)
    assert slots(blocked, "a").blocked
    assert slots(with_lora(cand("x"), [], max_loras=0), "a").free  # an engine that reports no slots


def test_the_instance_holding_the_adapter_wins_over_a_slightly_idler_one():
    holder = with_lora(cand("h", prefill=800), ["a"])
    idle = with_lora(cand("i"), ["b"])
    # A cold load (0.4 x 0.25 s at the prior's 0.1 ms a token: 1000 tokens) outweighs 800 queued prefill tokens
    # at kv_affinity's load weight (1, pressure scaling off); 1200 do not.
    policy = LoraAffinity(Params(pressure_scale=0.0))
    assert policy.pick(ask(), [idle, holder]).instance_id == "h"
    assert policy.pick(ask(), [idle, with_lora(cand("h", prefill=1200), ["a"])]).instance_id == "i"


def test_a_second_placement_needs_relief_beyond_its_load_cost_times_the_spread_factor():
    policy = LoraAffinity(Params(spread_factor=2.0, pressure_scale=0.0, load_weight=1.0, cold_weight=1.0))
    idle = with_lora(cand("i"), [])
    # Load on the holder below 2 x 2500 tokens: stay (sticky); well above it: spread.
    assert policy.pick(ask(), [idle, with_lora(cand("h", prefill=4000), ["a"])]).instance_id == "h"
    assert policy.pick(ask(), [idle, with_lora(cand("h", prefill=6000), ["a"])]).instance_id == "i"


def test_without_a_holder_a_free_slot_beats_evicting_a_popular_adapter():
    policy = LoraAffinity()
    for t in range(20):  # adapter b is requested often
        policy.pick(ask("b"), [with_lora(cand("x"), [], at=t * 0.1), with_lora(cand("y"), [], max_loras=0)])
    full = with_lora(cand("x"), ["b"], max_loras=1, at=2.0)
    free = with_lora(cand("y", prefill=500), ["c"], max_loras=2, at=2.0)
    assert policy.pick(ask("a"), [full, free]).instance_id == "y"


def test_an_instance_whose_slots_are_all_busy_is_left_out_while_another_can_take_the_adapter():
    blocked = with_lora(cand("b"), ["x", "y"], active=["x", "y"], max_loras=2)
    busy_but_open = with_lora(cand("o", prefill=20000), ["x"], max_loras=2)
    assert LoraAffinity().pick(ask(), [blocked, busy_but_open]).instance_id == "o"
    # Every candidate blocked: the request still goes somewhere.
    assert LoraAffinity().pick(ask(), [blocked]).instance_id == "b"


def test_the_adapters_own_kv_hits_count():
    a = with_lora(cand("a", npu=8), ["a"])
    b = with_lora(cand("b"), ["a"])
    assert LoraAffinity().pick(ask(isl=160), [b, a]).instance_id == "a"


def test_a_burst_follows_its_first_placement_before_the_heartbeat_shows_it():
    policy = LoraAffinity()
    pool = [with_lora(cand("x"), []), with_lora(cand("y"), [])]
    first = policy.pick(ask(), pool).instance_id
    assert all(policy.pick(ask(), pool).instance_id == first for _ in range(5))


def test_base_model_requests_are_kv_affinity():
    a, b = cand("a", prefill=100), cand("b")
    assert LoraAffinity().pick(facts(), [a, b]).instance_id == "b"
