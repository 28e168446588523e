"""The overload simulation (`python -m bench.fleet overload`) on a short run: the coordinator's admission core in
virtual time serves priority traffic sooner under a 3x burst, refuses only what it cannot hold, and leaks nothing."""

from __future__ import annotations

from bench.fleet.overload import OverloadConfig, OverloadFleet, arrivals, capacity, cmd_overload
from coordinator.tenants import Tier


def test_a_burst_is_held_and_priority_goes_first():
    base = OverloadConfig(steady_s=10.0, burst_s=5.0, burst=3.0)
    rate = capacity(base)
    assert 5 < rate < 50
    off = OverloadFleet(OverloadConfig(**{**base.__dict__, "admission": False})).run(arrivals(rate, base))
    on = OverloadFleet(base).run(arrivals(rate, base))
    assert off.residual == 0 and on.residual == 0
    for tier in (Tier.PRIORITY, Tier.FLEX):
        assert on.tiers[tier].sent == off.tiers[tier].sent
        served = on.tiers[tier].sent - on.tiers[tier].refused
        assert len(on.tiers[tier].ttft_s) == served  # everything admitted completed
    assert on.tiers[Tier.PRIORITY].refused == 0 and on.queue_peak > 0
    p50 = sorted(on.tiers[Tier.PRIORITY].ttft_s)[len(on.tiers[Tier.PRIORITY].ttft_s) // 2]
    p50_off = sorted(off.tiers[Tier.PRIORITY].ttft_s)[len(off.tiers[Tier.PRIORITY].ttft_s) // 2]
    assert p50 < p50_off
    assert on.tiers[Tier.PRIORITY].met > off.tiers[Tier.PRIORITY].met
    # Headroom (as it ships) against none: lower tiers stop before priority's SLO is full.
    full = OverloadFleet(OverloadConfig(**{**base.__dict__, "headroom": 1.0})).run(arrivals(rate, base))
    assert on.tiers[Tier.PRIORITY].met > full.tiers[Tier.PRIORITY].met


def test_the_command_writes_one_row_per_burst_admission_and_tier():
    class Args:
        instances, steady, steady_s, burst_s, seed, bursts = 2, 0.8, 3.0, 2.0, 0, [3.0]

    text, rows = cmd_overload(Args, lambda n: None)
    assert len(rows) == 6 and "| 3x | on, headroom 0.5 | flex |" in text and "| 3x | on, headroom 1 |" in text
