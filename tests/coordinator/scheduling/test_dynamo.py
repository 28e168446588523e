import pytest

from coordinator.scheduling import create_policy
from tests.coordinator.scheduling.fakes import cand, facts


@pytest.mark.parametrize(
    ("params", "candidate", "cost"),
    [
        # 160 tokens = 10 blocks; no load, no hits: prefill 10 + decode 10
        ({}, cand("a"), 20.0),
        ({}, cand("a", npu=4), 16.0),
        ({}, cand("a", npu=2, cpu=4, disk=4), 20.0 - 2 - 3 - 1),  # credits 1.0 / 0.75 / 0.25
        ({}, cand("a", prefill=32, context=64), 20.0 + 2 + 4),  # active prefill and context blocks
        ({"prefill_load_scale": 2.0}, cand("a", npu=4), 12.0 + 10),
        ({"decode_active_request_weight": 1.5}, cand("a", inflight=2), 23.0),
        ({}, cand("a", npu=30), 10.0),  # credit beyond the prompt saves no more than the prompt
    ],
)
def test_cost(params, candidate, cost):
    assert create_policy("dynamo", params).cost(facts(isl=160), candidate) == pytest.approx(cost)


def test_argmin_at_temperature_zero_with_random_ties():
    policy = create_policy("dynamo", {"seed": 7})
    assert policy.pick(facts(), [cand("a", npu=5), cand("b", npu=1)]).instance_id == "a"
    picks = {policy.pick(facts(), [cand("a"), cand("b"), cand("c")]).instance_id for _ in range(40)}
    assert picks == {"a", "b", "c"}


def test_temperature_prefers_low_cost_but_explores():
    policy = create_policy("dynamo", {"router_temperature": 0.5, "seed": 1})
    picks = [policy.pick(facts(), [cand("a", npu=10), cand("b")]).instance_id for _ in range(400)]
    assert picks.count("a") > picks.count("b") > 0
    again = create_policy("dynamo", {"router_temperature": 0.5, "seed": 1})
    assert picks == [again.pick(facts(), [cand("a", npu=10), cand("b")]).instance_id for _ in range(400)]
