import pytest

from coordinator.scheduling import create_policy
from tests.coordinator.scheduling.fakes import cand, facts


def test_scores_are_weighted_sums():
    policy = create_policy("llm_d")
    a = cand("a", npu=5, waiting=4, kv_usage=0.5)  # prefix 5/10, queue 0 (the longest), kv 0.5
    b = cand("b", waiting=0, kv_usage=0.0)  # prefix 0, queue 1, kv 1
    assert policy.scores(facts(isl=160), [a, b]) == pytest.approx([3 * 0.5 + 2 * 0.5 + 0, 0 + 2 * 1 + 2 * 1])


@pytest.mark.parametrize(
    ("params", "candidates", "expected"),
    [
        ({}, [cand("a", npu=10), cand("b")], "a"),
        ({}, [cand("a", npu=10, waiting=10, kv_usage=0.9), cand("b")], "b"),
        ({"prefix_weight": 10}, [cand("a", npu=10, waiting=10, kv_usage=0.9), cand("b")], "a"),
    ],
)
def test_picks_highest_score(params, candidates, expected):
    assert create_policy("llm_d", params).pick(facts(isl=160), candidates).instance_id == expected


def test_lora_affinity_scorer_as_llm_d_scores_it():
    from dataclasses import replace

    from coordinator.scheduling.llm_d import LlmD, lora_score

    def lora(c, active, max_loras=2):
        c.state.load.active_adapters, c.state.load.max_loras = frozenset(active), max_loras
        return c

    active, free, full = lora(cand("a"), ["x"]), lora(cand("f"), ["y"]), lora(cand("u"), ["y", "z"])
    assert [lora_score(c, "x") for c in (active, free, full)] == [1.0, 0.8, 0.0]
    request = replace(facts(), adapter="x")
    assert LlmD().pick(request, [full, free, active]).instance_id == "a"
    assert (
        LlmD().scores(facts(), [full, active]) == LlmD().scores(facts(), [active, full])[::-1]
    )  # base: no term
