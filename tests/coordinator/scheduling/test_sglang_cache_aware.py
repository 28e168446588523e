import pytest

from coordinator.scheduling import RequestFacts, create_policy
from tests.coordinator.scheduling.fakes import cand, facts


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        # balanced, match rate 64/160 = 0.4 > 0.3: the cache holder
        ([cand("a", npu=4, inflight=3), cand("b", inflight=0)], "a"),
        # balanced, match rate 32/160 = 0.2: the least loaded (ties: first in id order)
        ([cand("b", npu=2), cand("a")], "a"),
        ([cand("a", npu=2, inflight=2), cand("b", inflight=1)], "b"),
        # imbalanced (100 - 10 > 64 and 100 > 15): least loaded, whatever the cache
        ([cand("a", npu=10, inflight=100), cand("b", inflight=10)], "b"),
        # a gap of 64 is not more than 64: still balanced
        ([cand("a", npu=10, inflight=74), cand("b", inflight=10)], "a"),
        # gap 80 > 64 but 280 <= 200 * 1.5: still balanced
        ([cand("a", npu=10, inflight=280), cand("b", inflight=200)], "a"),
    ],
)
def test_decisions(candidates, expected):
    policy = create_policy("sglang_cache_aware", {"tree": "kv_events"})
    assert policy.pick(facts(isl=160), candidates).instance_id == expected


def test_routed_prompts_enter_the_chosen_workers_tree_at_routing_time():
    # As SGLang's router: the prompt is inserted into the chosen worker's tree when routed, before any engine
    # reports caching it; the conductor's facts are not used.
    policy = create_policy("sglang_cache_aware")
    first = RequestFacts("r1", "m", 160, 16, prompt_hashes=tuple(range(10)))
    cands = [cand("a"), cand("b", npu=10)]
    assert policy.pick(first, cands).instance_id == "a"  # nothing routed yet: least loaded, id order
    burst = RequestFacts("r2", "m", 160, 16, prompt_hashes=tuple(range(10)))
    busy_a = [cand("b", npu=10), cand("a", inflight=3)]
    assert policy.pick(burst, busy_a).instance_id == "a"  # a's tree holds it: a, though busier
    other = RequestFacts("r3", "m", 160, 16, prompt_hashes=(99, 98))
    assert policy.pick(other, busy_a).instance_id == "b"  # no match: least loaded


def test_below_threshold_smallest_tree_variant():
    policy = create_policy("sglang_cache_aware", {"below_threshold": "smallest_tree"})
    cands = [cand("a"), cand("b")]
    assert policy.pick(facts(isl=1000), cands).instance_id == "a"  # a's tree: 1000 tokens
    assert policy.pick(facts(isl=10), cands).instance_id == "b"  # b's tree: 10
    assert policy.pick(facts(isl=10), cands).instance_id == "b"  # b: 20 < 1000


def test_a_tree_grows_only_by_what_it_did_not_hold():
    # The router's tree size per worker counts distinct text: a prompt routed again adds nothing.
    policy = create_policy("sglang_cache_aware", {"below_threshold": "smallest_tree"})
    cands = [cand("a"), cand("b")]

    def request(blocks: range) -> RequestFacts:
        return RequestFacts("r", "m", 16 * len(blocks), 16, prompt_hashes=tuple(blocks))

    assert policy.pick(request(range(10)), cands).instance_id == "a"  # a's tree: 160 tokens
    assert policy.pick(request(range(100, 120)), cands).instance_id == "b"  # b's tree: 320
    for _ in range(3):  # the same prompt again: a cache hit on a, its tree stays at 160
        assert policy.pick(request(range(10)), cands).instance_id == "a"
    assert (
        policy.pick(request(range(200, 202)), cands).instance_id == "a"
    )  # cold: the smaller tree (160 < 320)


def test_below_threshold_least_load_by_default():
    # As sglang-router 0.3.2 decides (bench/sglang_parity.py: 100% of its decisions reproduced).
    policy = create_policy("sglang_cache_aware")
    assert policy.pick(facts(), [cand("a", inflight=5), cand("b", inflight=2)]).instance_id == "b"
