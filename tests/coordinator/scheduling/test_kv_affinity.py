import pytest

from coordinator.scheduling import create_policy
from coordinator.scheduling.kv_affinity import affinity_matched, prefill_cost
from tests.coordinator.scheduling.fakes import cand, facts


@pytest.mark.parametrize(
    ("params", "candidate", "isl", "matched", "cost"),
    [
        ({}, cand("a", npu=4), 160, 64, 96.0),
        ({}, cand("a", npu=2, cpu=2, disk=5), 160, 64, 96.0),  # disk credited 0 by default
        ({"w_disk": 1.0}, cand("a", npu=2, cpu=2, disk=5), 160, 144, 16.0),
        ({"w_cpu": 0.5}, cand("a", npu=2, cpu=3), 160, 56, 104.0),  # round((2 + 1.5) * 16) = 56
        ({}, cand("a", npu=20), 160, 160, 0.0),  # capped at the prompt
        ({"overlap_credit": 0.5}, cand("a", npu=4), 160, 64, 128.0),
    ],
)
def test_formulas(params, candidate, isl, matched, cost):
    p = create_policy("kv_affinity", params).params
    assert affinity_matched(p, candidate, isl) == matched
    assert prefill_cost(p, candidate, isl) == cost


@pytest.mark.parametrize(
    ("params", "candidates", "expected"),
    [
        # blend: the holder of the prefix wins while its load is low ...
        ({}, [cand("a", npu=8), cand("b")], "a"),
        # ... and loses when its load outweighs the saved prefill (128 saved < 300 queued prefill)
        ({}, [cand("a", npu=8, prefill=300), cand("b")], "b"),
        ({"load_weight": 0.25}, [cand("a", npu=8, prefill=300), cand("b")], "a"),  # 0.25 * 300 < 128
        # a decode token left weighs a quarter of a prefill token: 0.25 * 400 = 100 < 128 saved
        ({}, [cand("a", npu=8, decode=400), cand("b")], "a"),
        ({"decode_load_weight": 1.0}, [cand("a", npu=8, decode=400), cand("b")], "b"),
        ({"load_weight": 0.1}, [cand("a", npu=8, decode=200), cand("b")], "a"),
        ({"prefill_load_scale": 0.0}, [cand("a", npu=8, decode=5), cand("b")], "b"),
        # prefix: longest match whatever the load
        ({"mode": "prefix"}, [cand("a", npu=8, decode=10_000), cand("b", npu=2)], "a"),
        # load: KV ignored
        ({"mode": "load"}, [cand("a", npu=8, decode=10), cand("b")], "b"),
        # gate: only the N least-loaded are scored
        ({"load_gate_topn": 1}, [cand("a", npu=10, decode=50), cand("b", decode=10)], "b"),
        (
            {"load_gate_topn": 2},
            [cand("a", npu=10, decode=50), cand("b", decode=10), cand("c", decode=90)],
            "a",
        ),
        # cpu hits count, disk hits do not (default weights)
        ({}, [cand("a", cpu=6), cand("b", disk=9)], "a"),
    ],
)
def test_picks_at_a_fixed_load_weight(params, candidates, expected):
    fixed = {"pressure_scale": 0, **params}
    assert create_policy("kv_affinity", fixed).pick(facts(), candidates).instance_id == expected


@pytest.mark.parametrize(
    ("candidates", "expected", "params"),
    [
        # A 1,600-token prompt whose first 128 tokens `a` holds: the least any candidate computes is 1,472 tokens,
        # the first request's size. Short queues (mean load 150 <= 1,472): the load weighs load_weight (1), and
        # 300 queued tokens outweigh the 128 the holder saves.
        ([cand("a", npu=8, prefill=300), cand("b")], "b", None),
        # Long queues (mean load 14,500, about 10 requests): the weight falls to 1,472 / 14,500 = 0.10,
        # so the holder keeps the prefix while its extra load (0.10 * 1,000 = 102) is worth less than 128.
        ([cand("a", npu=8, prefill=15_000), cand("b", prefill=14_000)], "a", None),
        # ... and hands it on when the imbalance grows past that (0.095 * 3,000 = 285 > 128).
        ([cand("a", npu=8, prefill=17_000), cand("b", prefill=14_000)], "b", None),
        # A fixed weight (pressure_scale 0) copies the prefix at the same long queues.
        ([cand("a", npu=8, prefill=15_000), cand("b", prefill=14_000)], "b", {"pressure_scale": 0}),
    ],
)
def test_the_load_weight_falls_as_queues_grow(candidates, expected, params):
    policy = create_policy("kv_affinity", params)
    assert policy.pick(facts(isl=1600), candidates).instance_id == expected


@pytest.mark.parametrize(
    ("queued", "weight"),
    [
        (0, 1.0),  # nothing queued: the greedy weight
        (736, 1.0),  # half a request per instance
        (1472, 1.0),  # one request's uncached prompt (1,472 tokens) per instance: still 1
        (2944, 0.5),  # two: the copy would delay two queued requests, so the load weighs a half
        (14_720, 0.1),  # ten: a tenth
    ],
)
def test_the_load_weighs_one_over_the_queued_requests_past_one(queued, weight):
    policy = create_policy("kv_affinity")
    pool = [cand("a", npu=8, prefill=queued), cand("b", prefill=queued)]
    assert policy.load_weight(facts(isl=1600), pool) == pytest.approx(weight)


def test_the_request_size_is_a_running_mean():
    policy = create_policy("kv_affinity")
    queued = [cand("a", npu=8, prefill=15_000), cand("b", prefill=14_000)]
    assert policy.pick(facts(isl=1600), queued).instance_id == "a"
    # A run of small prompts shrinks the mean size: the same long queues now count as heavier pressure, and
    # the weight falls further (the holder would keep the prefix at a larger imbalance).
    for _ in range(50):
        policy.pick(facts(isl=16), [cand("a"), cand("b")])
    assert policy.load_weight(facts(isl=1600), queued) < 0.05


def test_mode_load_asks_no_match():
    assert create_policy("kv_affinity", {"mode": "load"}).needs_match is False
    assert create_policy("kv_affinity").needs_match is True


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"load_weight": -1}, "kv_affinity.load_weight: must be >= 0"),
        ({"overlap_credit": 1.5}, "kv_affinity.overlap_credit: must be between 0 and 1"),
        ({"mode": "fast"}, "kv_affinity.mode: must be one of"),
        ({"w_npu": "high"}, "kv_affinity.w_npu: must be a number"),
        ({"load_gate_topn": 1.5}, "kv_affinity.load_gate_topn: must be an integer"),
        ({"gate": 1}, "kv_affinity.gate: unknown parameter"),
        ({"pressure_scale": -1}, "kv_affinity.pressure_scale: must be >= 0"),
    ],
)
def test_bad_parameters_are_named(params, message):
    with pytest.raises(ValueError, match=message):
        create_policy("kv_affinity", params)
