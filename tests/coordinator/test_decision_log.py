"""The decision log (`coordinator.decision_log`): bounded, newest first, and filled by the picker with the same
score components the `tandem.score` span carries."""

from __future__ import annotations

import json

from coordinator.decision_log import Components, Decision, DecisionLog, components
from coordinator.picker import candidate_attributes
from tests.helpers import make_picker, pd_picker


def decision(i: int, model: str = "m") -> tuple:
    return tuple(Decision(float(i), f"r{i}", model, "least_load", "aggregated", 10, (), ("i0",)))


def test_the_ring_keeps_the_newest_and_lists_them_newest_first():
    log = DecisionLog(capacity=3)
    for i in range(5):
        log.record(decision(i, "m" if i % 2 else "other"))
    assert [d.request_id for d in log.recent()] == ["r4", "r3", "r2"]
    assert [d.request_id for d in log.recent(limit=2)] == ["r4", "r3"]
    assert [d.request_id for d in log.recent(model="m")] == ["r3"]
    assert log.recorded == 5 and log.capacity == 3


def test_capacity_zero_keeps_nothing():
    log = DecisionLog(capacity=0)
    log.record(decision(1))
    assert log.recent() == [] and log.recorded == 0


async def test_the_picker_records_each_decision_with_its_candidates_as_the_span_sees_them():
    picker = make_picker("kv_affinity", instances=3)
    body = json.dumps({"model": "m", "prompt": "hello there " * 20, "max_tokens": 4}).encode()
    first = await picker.decide("completions", body, "tdm-1")
    await picker.decide("completions", body, "tdm-2")
    newest, oldest = picker.decisions.recent()
    assert (newest.request_id, oldest.request_id) == ("tdm-2", "tdm-1")
    assert oldest.chosen == (first.target.instance.info.instance_id,)
    assert (oldest.model, oldest.policy, oldest.stage) == ("m", "kv_affinity", "aggregated")
    assert sorted(c.instance_id for c in oldest.candidates) == ["i0", "i1", "i2"]
    # The second decision saw the first one's workload committed on the first choice.
    chosen = next(c for c in newest.candidates if c.instance_id == oldest.chosen[0])
    assert components(chosen, newest.isl).prefill_tokens == first.request.prompt_tokens
    # One source of score components: the span's attributes are the same figures.
    attributes = candidate_attributes(newest.candidates, None, newest.isl)
    for c in newest.candidates:
        for name, value in components(c, newest.isl)._asdict().items():
            assert attributes[f"tandem.candidate.{c.instance_id}.{name}"] == value
    assert set(Components._fields) >= {"matched_npu_tokens", "prefill_tokens", "predicted_ttft_s"}


async def test_a_handoff_request_records_its_decode_and_prefill_choices():
    picker = pd_picker(["127.0.0.1:2", "127.0.0.1:3"])
    body = json.dumps({"model": "m", "prompt": "hi there", "max_tokens": 4}).encode()
    pick = await picker.decide("completions", body, "tdm-pd")
    leg = await picker.pick_prefill(pick, set())
    prefill, decode = picker.decisions.recent()
    assert (decode.stage, decode.chosen) == ("decode", ("d0",))
    assert (prefill.stage, prefill.chosen) == ("prefill", (leg.instance.info.instance_id,))
    assert prefill.request_id == decode.request_id == "tdm-pd"
