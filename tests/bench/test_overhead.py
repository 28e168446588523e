"""bench.overhead's idle window: per-engine cost and the issue's verdict."""

from __future__ import annotations

import os

from bench.overhead import IDLE_GOAL_PCT, Idle, idle_table, own_cpu_seconds


def test_idle_cost_per_engine_is_agent_and_engines_over_the_engine_count():
    idle = Idle(30.0, 2, {"agent": 0.5, "engines": 0.4, "envoy": 0.6, "coordinator": 0.3, "conductor": 0.1})
    assert idle.per_engine == 0.45
    text = idle_table(idle)
    assert f"<= {IDLE_GOAL_PCT:g}% of a core per engine: 0.45%, met" in text
    assert "| agent | engines | envoy | coordinator | conductor | agent + engine, per engine |" in text
    busy = Idle(30.0, 2, {"agent": 1.9, "engines": 3.2})
    assert "2.55%, not met" in idle_table(busy)


def test_own_cpu_counts_this_process_and_nothing_for_a_gone_one():
    before = own_cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))  # some CPU of our own
    assert own_cpu_seconds(os.getpid()) > before
    assert own_cpu_seconds(2**22 + 12345) == 0.0  # above any pid this machine hands out
