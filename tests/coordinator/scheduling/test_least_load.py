import pytest

from coordinator.scheduling import create_policy
from tests.coordinator.scheduling.fakes import cand, facts


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        ([cand("a", prefill=500), cand("b", prefill=100), cand("c", decode=300)], "b"),
        ([cand("a", prefill=60, decode=50), cand("b", decode=100)], "b"),  # prefill + decode tokens count
        ([cand("a", decode=100, inflight=3), cand("b", decode=100, inflight=1)], "b"),  # then fewer requests
        ([cand("a", running=4, waiting=2), cand("b", running=1)], "b"),  # then engine-reported requests
        (
            [cand("a", prefill=30000, inflight=1), cand("b", decode=900, inflight=9)],
            "b",
        ),  # tokens, not requests
    ],
)
def test_picks_fewest_tokens(candidates, expected):
    assert create_policy("least_load").pick(facts(), candidates).instance_id == expected


def test_spreads_ties_evenly():
    policy = create_policy("least_load")
    picks = [policy.pick(facts(), [cand("a"), cand("b"), cand("c")]).instance_id for _ in range(6)]
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]
