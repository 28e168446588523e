"""LoRA in the fleet simulator: slots, LRU eviction of idle adapters, parking, the load's stall, the workload and
the peers' rows (small, bounded runs)."""

from __future__ import annotations

import pytest

from bench.fleet.instance import EngineSpec
from bench.fleet.lora import (
    ROWS,
    DynamoLora,
    LoraInstance,
    LoraSpec,
    LoraWorkload,
    make_arrivals,
    run_row,
    zipf_weights,
)
from coordinator.scheduling import RequestFacts
from simengine.request import Request, SamplingParams
from simengine.sampler import Sampler
from tandem.tokenizer import load_tokenizer
from tests.coordinator.scheduling.fakes import cand


@pytest.fixture(scope="module")
def word_ids() -> list[int]:
    return load_tokenizer(None).word_ids


def engine(max_loras=2, load_s=0.5):
    loads = []
    inst = LoraInstance(
        "sim-0", "m", EngineSpec(npu_blocks=256), Sampler(list(range(1000, 1100)), 2), None,
        lora=LoraSpec(max_loras, load_s), on_load=loads.append,
    )  # fmt: skip
    return inst, loads


def request(inst, key, adapter, max_tokens=2):
    r = Request(
        f"r{key}-0",
        list(range(10, 42)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed_key=key),
        0.0,
    )
    inst.adapter_of[id(r)] = adapter
    inst.add(r)
    return r


def drain(inst, limit=50):
    for _ in range(limit):
        if inst.start_step() is None:
            return
        inst.end_step()
    raise AssertionError("the engine did not drain")


def test_slots_load_evict_the_least_recently_used_idle_adapter_and_park_when_all_are_busy():
    inst, loads = engine(max_loras=2, load_s=0.5)
    request(inst, 1, "a")
    request(inst, 2, "b")
    assert [r.request_id for r in loads] == ["r1-0", "r2-0"] and list(inst.slots) == ["a", "b"]
    step = inst.start_step()
    assert step is not None and step >= 1.0  # the two loads stall the step
    inst.end_step()
    parked = request(inst, 3, "c")  # both slots busy: waits
    assert list(inst.parked) == [parked]
    inst.report_load(1.0)
    assert inst.state.load.active_adapters == {"a", "b", "c"} and inst.state.load.waiting >= 1
    drain(inst)
    assert not inst.parked and len(loads) == 3 and "c" in inst.slots and "a" not in inst.slots  # a was LRU
    request(inst, 4, "b")  # resident: no load
    assert len(loads) == 3
    drain(inst)
    inst.report_load(2.0)
    assert inst.state.load.adapters == {"b", "c"} and not inst.state.load.active_adapters
    assert inst.state.load.max_loras == 2


def test_workload_is_zipf_over_adapters_and_shifting_reranks_them(word_ids):
    w = LoraWorkload(adapters=20, instances=2, requests=600, seed=1)
    arr = make_arrivals(w, EngineSpec(), word_ids)
    counts = {}
    for a in arr.adapter.values():
        counts[a] = counts.get(a, 0) + 1
    assert (
        counts["lora-000"] > counts.get("lora-019", 0)
        and abs(counts["lora-000"] / 600 - zipf_weights(20, 1)[0]) < 0.06
    )
    # Every prompt starts with its adapter's own system prompt: no block is shared across adapters.
    first = {}
    for k, a in arr.adapter.items():
        first.setdefault(a, arr.prompts[k][: w.prefix_tokens])
        assert arr.prompts[k][: w.prefix_tokens] == first[a]
    assert len({tuple(p[:16]) for p in first.values()}) == len(first)
    shifting = make_arrivals(
        LoraWorkload(adapters=20, instances=2, requests=600, seed=1, shifting=True), EngineSpec(), word_ids
    )
    late = [shifting.adapter[k] for k in range(400, 600)]
    assert max(set(late), key=late.count) != "lora-000" or late.count("lora-000") < counts["lora-000"] / 3


def test_dynamo_lora_pins_a_new_adapter_once_its_controller_has_seen_it():
    policy = DynamoLora()
    pool = [cand(f"sim-{i}") for i in range(4)]
    for c in pool:
        c.state.load.max_loras = 2
    policy.pick(RequestFacts("r0", "m", 64, 4, adapter="x"), pool)  # not in the routing table yet: any worker
    for c in pool:
        c.state.load.sampled_at = 3.0  # the controller's next tick
    chosen = {
        policy.pick(RequestFacts(f"r{k}", "m", 64, 4, adapter="x"), pool).instance_id for k in range(20)
    }
    assert len(chosen) == 1  # a little-used adapter is pinned to its top-ranked worker


@pytest.mark.parametrize("label", list(ROWS))
def test_every_row_runs_and_counts_cold_loads(label, word_ids):
    w = LoraWorkload(adapters=10, instances=2, requests=80, warmup=8)
    result, cold = run_row((w, label, LoraSpec(max_loras=2), EngineSpec(), word_ids))
    assert len(result.ttft_s) == 72 and 0 < cold <= 72
    again, cold_again = run_row((w, label, LoraSpec(max_loras=2), EngineSpec(), word_ids))
    assert again.ttft_s == result.ttft_s and cold_again == cold  # deterministic
