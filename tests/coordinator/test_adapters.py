"""A request naming a LoRA adapter (its `model` field): resolved to the adapter's base model, routed among the base
model's instances that hold the adapter or can take it, the conductor asked about the adapter's own KV blocks;
an unknown name is vLLM's 404; `/v1/models` lists each adapter under its base model."""

import json

import pytest

from coordinator.adapter_placement import AdapterHolds, LoadFailure
from coordinator.decision import Decider, models_listing
from coordinator.errors import OpenAIError
from coordinator.scheduling import KvMatch
from tandem.chain_hash import adapter_root, chain_hashes
from tandem.engine_load import EngineLoad
from tandem.tokenizer import load_tokenizer
from tests.helpers import make_picker

PROMPT = "hello adapter world " * 20


def body(model: str, **fields) -> bytes:
    return json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 4, **fields}).encode()


def lora_picker(policy="least_load", instances=3, matcher=None, **loads):
    """Model `m` with adapters `a` and `b`; instance loads by id (`i0=EngineLoad(...)`)."""
    picker = make_picker(policy, instances, matcher)
    picker.adapters = {"a": "m", "b": "m"}
    for iid, load in loads.items():
        picker.instances.get(iid).load = load
    return picker


def lora(*adapters: str, max_loras: int = 1) -> EngineLoad:
    return EngineLoad(adapters=frozenset(adapters), max_loras=max_loras)


async def test_an_adapter_name_is_understood_as_its_base_model_with_the_adapter():
    picker = lora_picker()
    request = picker.understand("completions", body("a"))
    assert (request.model, request.adapter) == ("m", "a")
    assert request.body["model"] == "a"  # the engine gets the adapter's name: vLLM serves it by that name
    base = picker.understand("completions", body("m"))
    assert (base.model, base.adapter) == ("m", "")
    assert request.prompts == base.prompts  # the base model's tokenizer


async def test_an_unknown_model_or_adapter_is_vllms_404():
    picker = lora_picker()
    with pytest.raises(OpenAIError) as info:
        await picker.decide("completions", body("nope"), "r")
    error = json.loads(info.value.body())["error"]
    assert error == {
        "message": "The model `nope` does not exist. Models served: m; adapters: a, b.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    assert picker.ledger.total_requests == 0


@pytest.mark.parametrize("policy", ["least_load", "round_robin", "lora_affinity"])
async def test_any_policy_picks_among_instances_that_hold_the_adapter_or_have_a_free_slot(policy):
    # i0 holds `a`; i1 holds `b` in its only slot; i2 has a free slot.
    picker = lora_picker(policy, i0=lora("a"), i1=lora("b"), i2=lora(max_loras=2))
    chosen = set()
    for n in range(8):
        pick = await picker.decide("completions", body("a"), f"r{n}")
        chosen.add(pick.target.instance.info.instance_id)
        picker.release(pick.target)
    assert chosen <= {"i0", "i2"} and chosen
    # The base model goes anywhere.
    base = {
        (await picker.decide("completions", body("m"), f"m{n}")).target.instance.info.instance_id
        for n in range(6)
    }
    assert "i1" in base or policy == "lora_affinity"


async def test_lora_affinity_keeps_an_adapter_on_the_instance_that_holds_it():
    picker = lora_picker(
        "lora_affinity", i0=lora(max_loras=2), i1=lora("a", max_loras=2), i2=lora(max_loras=2)
    )
    for n in range(4):
        pick = await picker.decide("completions", body("a"), f"r{n}")
        assert pick.target.instance.info.instance_id == "i1"
        picker.release(pick.target)


async def test_when_no_instance_holds_it_or_has_a_free_slot_every_instance_is_a_candidate():
    picker = lora_picker(i0=lora("b"), i1=lora("b"), i2=lora("b"))
    pick = await picker.decide("completions", body("a"), "r")
    assert pick.target.instance.info.instance_id in {"i0", "i1", "i2"}


async def test_instances_held_back_after_a_failed_load_are_not_chosen_and_all_held_back_is_a_clear_error():
    picker = lora_picker(i0=lora(), i1=lora(), i2=lora())
    holds = picker.placement = AdapterHolds(failed_hold_s=60, loaded_memory_s=5)
    import time

    now = time.monotonic()
    holds.failed("i0", "a", LoadFailure("the load on instance `i0` failed: no adapter", False, now))
    holds.failed("i1", "a", LoadFailure("the load on instance `i1` failed: no adapter", False, now))
    for n in range(4):
        pick = await picker.decide("completions", body("a"), f"r{n}")
        assert pick.target.instance.info.instance_id == "i2"
        picker.release(pick.target)
    assert (await picker.decide("completions", body("b"), "b")).target  # other adapters are not held back
    holds.failed("i2", "a", LoadFailure("the load on instance `i2` failed: no adapter", False, now + 1))
    with pytest.raises(OpenAIError) as info:
        await picker.decide("completions", body("a"), "r")
    assert info.value.status == 500
    assert "`a` could not be loaded on any instance of `m`" in info.value.message
    assert "i2" in info.value.message


class AdapterMatcher:
    """A conductor that records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, tuple[int, ...]]] = []

    async def match(self, request_id, model, token_ids, candidates, block_size=0, hashes=None, adapter=""):
        self.asked.append((adapter, tuple(hashes or ())))
        return {c: KvMatch(npu_blocks=1, block_size=block_size) for c in candidates}


async def test_the_conductor_is_asked_about_the_adapters_own_blocks():
    matcher = AdapterMatcher()
    picker = lora_picker("lora_affinity", matcher=matcher)
    await picker.decide("completions", body("a"), "r1")
    await picker.decide("completions", body("m"), "r2")
    tokens = load_tokenizer(None).encode(PROMPT)
    (adapter, hashes), (base_adapter, base_hashes) = matcher.asked
    assert adapter == "a" and hashes == tuple(chain_hashes(tokens, 16, parent=adapter_root("a")))
    assert base_adapter == "" and base_hashes == tuple(chain_hashes(tokens, 16))
    assert hashes != base_hashes


def test_models_listing_names_each_adapter_under_its_base_model_as_vllm_does():
    data = models_listing(["m", "n"], {"a": "m", "b": "m", "x": "gone"}, 7)
    assert [(d["id"], d["parent"]) for d in data] == [("m", None), ("a", "m"), ("b", "m"), ("n", None)]
    assert all(d["object"] == "model" and d["created"] == 7 for d in data)


def test_v1_models_answer_lists_adapters():
    picker = lora_picker()
    decider = Decider(picker, None, None, None)  # type: ignore[arg-type]
    answer = decider.without_body("GET", "/v1/models")
    assert answer is not None and answer.status == 200
    ids = [(d["id"], d["parent"]) for d in json.loads(answer.body)["data"]]
    assert ids == [("m", None), ("a", "m"), ("b", "m")]


# -- unloading: the least recently used idle adapter, past the engine's slots -------------------------------------


def test_unload_victim_is_the_least_recently_used_idle_adapter_past_the_slots():
    from coordinator.adapter_placement import unload_victim

    picker = lora_picker(i0=lora("a", "b", max_loras=2))
    state = picker.instances.get("i0")
    held = frozenset({"a", "b"})
    # Loading `c` makes three for two slots: `b` was used longer ago than `a`.
    assert unload_victim(state, "c", held, {}, {"a": 5.0, "b": 1.0}) == "b"
    assert (
        unload_victim(state, "c", held, {"b": 1}, {"a": 5.0, "b": 1.0}) == "a"
    )  # `b` has a request in flight
    assert unload_victim(state, "c", held, {"a": 1, "b": 2}, {}) is None  # both busy: nothing is unloaded
    assert (
        unload_victim(state, "c", held, {}, {"a": 5.0}) == "b"
    )  # never routed through this coordinator: oldest
    assert unload_victim(state, "a", held, {}, {}) is None  # within the slots
    state.load = EngineLoad(adapters=held, active_adapters=frozenset({"b"}), max_loras=2)
    assert unload_victim(state, "c", held, {}, {"a": 5.0, "b": 1.0}) == "a"  # the engine runs `b`
    state.load = EngineLoad(adapters=held)  # no slot count reported: never
    assert unload_victim(state, "c", held, {}, {}) is None


def test_holds_know_their_own_loads_and_unloads_until_the_heartbeat_does():
    picker = lora_picker(i0=lora("a", "b", max_loras=2))
    state = picker.instances.get("i0")
    holds = AdapterHolds(failed_hold_s=30, loaded_memory_s=5)
    holds.loaded("i0", "c", 100.0)
    holds.unloaded("i0", "b", 100.0)
    assert holds.resident(state, 101.0) == {"a", "c"}
    assert holds.resident(state, 106.0) == {"a", "b"}  # past the memory: the heartbeat's word
    holds.routed("i0", "a", 100.0)
    holds.routed("i0", "a", 102.0)
    assert holds.inflight("i0") == {"a": 2} and holds.last_used("i0") == {"a": 102.0}
    holds.ended("i0", "a")
    holds.ended("i0", "a")
    assert holds.inflight("i0") == {}
