import math

from coordinator.predicted_cache import PredictedCache
from coordinator.scheduling import KvMatch


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_routed_prompt_counts_as_cached_until_its_lifetime_ends():
    clock = Clock()
    cache = PredictedCache(2.0, clock)
    cache.routed("a", [1, 2, 3])
    cache.routed("b", [1, 9])
    assert cache.blocks([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert cache.blocks([1, 9], candidates=["b"]) == {"b": 2}
    assert cache.blocks([7, 1]) == {}
    clock.t = 1.9
    assert cache.blocks([1, 2]) == {"a": 2, "b": 1}
    clock.t = 2.1
    assert cache.blocks([1, 2]) == {} and len(cache) == 0


def test_routing_again_refreshes_the_lifetime():
    clock = Clock()
    cache = PredictedCache(1.0, clock)
    cache.routed("a", [1, 2])
    clock.t = 0.8
    cache.routed("a", [1, 2])
    clock.t = 1.5
    assert cache.blocks([1, 2]) == {"a": 2}


def test_overlay_credits_predicted_blocks_and_confirmation_drops_them():
    clock = Clock()
    cache = PredictedCache(5.0, clock)
    cache.routed("a", [1, 2, 3, 4])
    facts = {"a": KvMatch(1, 1, 0, 16), "b": KvMatch(2, 0, 0, 16)}
    merged = cache.overlay([1, 2, 3, 4], facts, ["a", "b"], 16)
    assert merged["a"] == KvMatch(3, 1, 0, 16) and merged["b"] == facts["b"]
    # The engine's events reached the index: the prediction is confirmed and dropped.
    confirmed = cache.overlay([1, 2, 3, 4], {"a": KvMatch(4, 0, 0, 16)}, ["a", "b"], 16)
    assert confirmed["a"] == KvMatch(4, 0, 0, 16) and len(cache) == 0


def test_overlay_without_conductor_answer_still_predicts():
    cache = PredictedCache(5.0, Clock())
    cache.routed("a", [1, 2])
    assert cache.overlay([1, 2], None, ["a", "b"], 16) == {"a": KvMatch(2, 0, 0, 16)}


def test_zero_lifetime_is_off_and_infinite_is_bounded_by_size():
    off = PredictedCache(0.0, Clock())
    off.routed("a", [1])
    assert off.blocks([1]) == {}
    tree = PredictedCache(math.inf, Clock(), max_entries=3)
    tree.routed("a", [1, 2])
    tree.routed("b", [5, 6])
    assert tree.blocks([1, 2]) == {}  # the oldest entry left first
    assert tree.blocks([5, 6]) == {"b": 2}
