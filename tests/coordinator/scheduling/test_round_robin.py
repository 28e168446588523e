from coordinator.scheduling import RequestFacts, create_policy
from tests.coordinator.scheduling.fakes import cand, facts


def test_cycles_in_id_order_per_model():
    policy = create_policy("round_robin")
    cands = [cand("i2"), cand("i0"), cand("i1")]
    assert [policy.pick(facts(), cands).instance_id for _ in range(6)] == ["i0", "i1", "i2", "i0", "i1", "i2"]
    assert policy.pick(RequestFacts("r", "other", 1, 1), cands).instance_id == "i0"  # its own turn counter
    assert policy.needs_match is False
