"""bench.overhead's idle window: per-engine cost and the issue's verdict."""

from __future__ import annotations

import os

from bench.overhead import IDLE_GOAL_PCT, Idle, PathStats, idle_table, own_cpu_seconds, verdicts_24


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


def test_issue_24_verdicts_take_the_default_policy_the_best_peer_and_the_node_agent():
    def stats(latencies, cpu_s, agent_s=0.0):
        s = PathStats(latencies=latencies, cpu_s=cpu_s, agent_s=agent_s)
        s.cpu_by = {"envoy": cpu_s / 2, "coordinator": cpu_s / 2}
        return s

    results = {
        "non-streaming": {
            "tandem kv_affinity": stats(
                [0.03] * 1000, 0.35, 0.7
            ),  # 0.35 CPU s / 1k in the router, 1.05 in all
            "sglang-router cache_aware": stats([0.03] * 1000, 0.2),
            "vllm-router round_robin": stats([0.03] * 1000, 0.18),
        },
        "non-streaming, concurrency 1": {
            "direct": stats([0.0280] * 200, 0.0),
            "tandem kv_affinity": stats([0.0285] * 200, 1.0),
        },
    }
    text = verdicts_24(results)
    assert "| 0.35 | 0.36 (2 x 0.18) | met |" in text
    assert (
        "| the whole mesh, node agent included, <= 1.0 CPU s / 1k requests | 1.05 | 1.00 | not met |" in text
    )
    assert "| +0.50 | +1.00 | met |" in text
