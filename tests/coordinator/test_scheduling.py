import pytest

from coordinator.instances import EngineLoad, InstanceInfo, InstanceState
from coordinator.scheduling import Candidate, RequestFacts, create_policy

FACTS = RequestFacts("r", "m", prompt_tokens=10, max_tokens=5)


def cand(iid: str, tokens: int = 0, inflight: int = 0, running: int = 0, waiting: int = 0) -> Candidate:
    info = InstanceInfo(iid, "m", f"127.0.0.1:{8000 + int(iid[-1])}", "hybrid", "aggregated")
    return Candidate(InstanceState(info=info, load=EngineLoad(running, waiting)), tokens, inflight)


def test_round_robin_cycles_in_id_order_per_model():
    policy = create_policy("round_robin")
    cands = [cand("i2"), cand("i0"), cand("i1")]
    picks = [policy.pick(FACTS, cands).instance_id for _ in range(6)]
    assert picks == ["i0", "i1", "i2", "i0", "i1", "i2"]
    other = RequestFacts("r", "other", 1, 1)
    assert policy.pick(other, cands).instance_id == "i0"  # its own turn counter


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        ([cand("i0", tokens=500), cand("i1", tokens=100), cand("i2", tokens=300)], {"i1"}),
        # tokens tie: fewer in-flight requests wins
        ([cand("i0", tokens=100, inflight=3), cand("i1", tokens=100, inflight=1)], {"i1"}),
        # tokens and in-flight tie: fewer engine-reported requests wins
        ([cand("i0", running=4, waiting=2), cand("i1", running=1)], {"i1"}),
        # a long prompt in flight outweighs many short ones
        ([cand("i0", tokens=30000, inflight=1), cand("i1", tokens=900, inflight=9)], {"i1"}),
    ],
)
def test_least_load_picks_fewest_tokens(candidates, expected):
    assert create_policy("least_load").pick(FACTS, candidates).instance_id in expected


def test_least_load_spreads_ties_evenly():
    policy = create_policy("least_load")
    cands = [cand("i0"), cand("i1"), cand("i2")]
    picks = [policy.pick(FACTS, cands).instance_id for _ in range(6)]
    assert sorted(picks) == ["i0", "i0", "i1", "i1", "i2", "i2"]


def test_unknown_policy_names_known_ones():
    with pytest.raises(ValueError, match="unknown scheduling policy 'fastest'.*least_load.*round_robin"):
        create_policy("fastest")
