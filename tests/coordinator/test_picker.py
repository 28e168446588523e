import json

import pytest

from coordinator.config import CoordinatorConfig, PdMode
from coordinator.errors import OpenAIError
from coordinator.instances import Health, InstanceInfo, InstanceTable
from coordinator.picker import EndpointPicker
from coordinator.scheduling import KvMatch
from coordinator.understanding import TokenizerCache
from coordinator.workload import WorkloadLedger
from tandem.tokenizer import load_tokenizer
from tests.helpers import make_picker


def body(**fields) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


async def test_decision_commits_prompt_plus_output_tokens():
    picker = make_picker()
    d = await picker.decide("completions", body(prompt="hello there world", max_tokens=10), "r1")
    prompt_len = len(load_tokenizer(None).encode("hello there world"))
    iid = d.target.instance.info.instance_id
    assert d.request.prompt_tokens == prompt_len
    assert (picker.ledger.prefill_tokens(iid), picker.ledger.decode_tokens(iid)) == (prompt_len, 10)
    assert picker.ledger.context_tokens(iid) == prompt_len + 10
    assert picker.release(d.target) is True and picker.release(d.target) is False
    assert picker.ledger.total_tokens == 0


async def test_completions_default_max_tokens_and_n_and_prompt_lists():
    picker = make_picker()
    d = await picker.decide("completions", body(prompt=["a b", "c d e"], n=2), "r")
    assert len(d.request.prompts) == 2
    assert d.request.max_tokens == 16 * 2 * 2  # vLLM's default 16, per prompt and choice


async def test_least_load_spreads_concurrent_requests():
    picker = make_picker()
    first = await picker.decide(
        "chat.completions", body(messages=[{"role": "user", "content": "x " * 200}]), "a"
    )
    second = await picker.decide("chat.completions", body(messages=[{"role": "user", "content": "y"}]), "b")
    assert first.target.instance.info.instance_id != second.target.instance.info.instance_id


@pytest.mark.parametrize(
    ("api", "raw", "status", "fragment"),
    [
        ("completions", b"{not json", 400, "not valid JSON"),
        ("completions", b"[1, 2]", 400, "JSON object"),
        ("completions", b"", 400, "empty"),
        ("completions", json.dumps({"prompt": "x"}).encode(), 400, "`model` is required"),
        ("completions", body(), 400, "`prompt` is required"),
        ("completions", body(prompt="x", max_tokens=0), 400, "max_tokens"),
        ("completions", body(prompt="x", stream="yes"), 400, "stream"),
        ("completions", body(prompt=[1, -5]), 400, "out of vocabulary"),
        ("chat.completions", body(messages=[]), 400, "messages"),
        ("chat.completions", body(messages=[{"content": "no role"}]), 400, "role"),
        ("completions", json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "`nope` does not exist"),
    ],
)
async def test_errors(api, raw, status, fragment):
    picker = make_picker()
    with pytest.raises(OpenAIError) as info:
        await picker.decide(api, raw, "r")
    assert info.value.status == status
    assert fragment in info.value.message
    error = json.loads(info.value.body())["error"]
    assert (
        error["code"] == status and error["message"] == info.value.message and error["type"].endswith("Error")
    )
    assert picker.ledger.total_requests == 0


async def test_no_routable_instance_is_503_and_known_model_stays_known():
    picker = make_picker(instances=2)
    picker.instances.get("i0").health = Health.UNHEALTHY
    picker.instances.get("i1").drained = True
    with pytest.raises(OpenAIError) as info:
        await picker.decide("completions", body(prompt="x"), "r")
    assert info.value.status == 503
    picker.instances.deregister("i0")
    picker.instances.deregister("i1")
    with pytest.raises(OpenAIError) as info:
        await picker.decide("completions", body(prompt="x"), "r")
    assert info.value.status == 503


async def test_drained_and_unhealthy_instances_get_nothing():
    picker = make_picker(policy="round_robin", instances=3)
    picker.instances.get("i0").drained = True
    picker.instances.get("i2").health = Health.UNHEALTHY
    picks = set()
    for i in range(6):
        picks.add(
            (await picker.decide("completions", body(prompt="x"), str(i))).target.instance.info.instance_id
        )
    assert picks == {"i1"}


async def test_predicted_cache_sends_a_burst_after_the_first_request():
    from coordinator.config import CoordinatorConfig, SchedulerConfig
    from coordinator.instances import InstanceInfo, InstanceTable
    from coordinator.picker import EndpointPicker
    from coordinator.predicted_cache import PredictedCache
    from coordinator.understanding import TokenizerCache
    from coordinator.workload import WorkloadLedger

    table = InstanceTable(["m"])
    for i in range(2):
        table.register(InstanceInfo(f"i{i}", "m", f"127.0.0.1:{8100 + i}", "hybrid", "aggregated"))
    # At the default load weight (1) waiting behind the first prompt costs as much as computing it again: weigh
    # the queue at half so that the credited prefix decides.
    config = CoordinatorConfig(
        scheduler=SchedulerConfig(
            policy="kv_affinity", kv_affinity={"predicted_cache": True, "load_weight": 0.5}
        )
    )
    tokenizers = TokenizerCache({}, load_tokenizer)
    picker = EndpointPicker(
        config, table, WorkloadLedger(), config.scheduler.build(), tokenizers, None, PredictedCache(5.0)
    )
    shared = "system prompt of a tenant " * 40
    first = await picker.decide("completions", body(prompt=shared + "question one", max_tokens=4), "a")
    second = await picker.decide("completions", body(prompt=shared + "question two", max_tokens=4), "b")
    # No conductor at all: the second follows the first on the prediction alone, with its prefix credited.
    assert second.target.instance.info.instance_id == first.target.instance.info.instance_id
    assert second.target.match.npu_blocks > 0
    assert second.target.commitment.prefill_tokens < second.request.prompt_tokens


async def test_commitment_carries_what_the_engine_counts_at_the_first_token():
    picker = make_picker()
    d = await picker.decide("completions", body(prompt=["a b", "c d e"], n=2), "r")
    assert d.target.commitment.prompt_tokens == d.request.prompt_tokens * 2


async def test_fallback_names_the_least_loaded_other_engine_of_the_pool():
    picker = make_picker(instances=3)
    assert (await picker.decide("completions", body(prompt="p"), "off")).fallback is None  # off unless asked
    picker.fallbacks = True
    busy = await picker.decide("completions", body(prompt="x " * 300, max_tokens=50), "busy")
    d = await picker.decide("completions", body(prompt="q"), "q")
    addresses = {s.info.instance_id: s.info.address for s in picker.instances.all()}
    chosen, loaded = d.target.instance.info.instance_id, busy.target.instance.info.instance_id
    (idle,) = set(addresses) - {chosen, loaded}
    assert d.fallback == addresses[idle]  # never the pick itself, and not the loaded engine
    single = make_picker(instances=1)
    single.fallbacks = True
    assert (await single.decide("completions", body(prompt="p"), "s")).fallback is None


# -- the P/D decode choice: a policy like the prefill one ----------------------------------------------------------


class RecordingMatcher:
    """A conductor that says `holder` holds the prompt's first four blocks, and records whom it was asked about."""

    def __init__(self, holder: str) -> None:
        self.holder = holder
        self.asked: list[list[str]] = []

    async def match(self, request_id, model, token_ids, candidates, block_size=0, hashes=None, adapter=""):
        self.asked.append(sorted(candidates))
        return {self.holder: KvMatch(npu_blocks=4, block_size=16)} if self.holder in candidates else {}


def decode_picker(matcher=None, **scheduler) -> EndpointPicker:
    """A handoff-mode picker of model `m`: decode instances `d0` (already busy) and `d1`, prefill instance `p0`."""
    table = InstanceTable(["m"])
    for iid, role in (("d0", "decode"), ("d1", "decode"), ("p0", "prefill")):
        table.register(InstanceInfo(iid, "m", "127.0.0.1:1", role, "handoff"))
    config = CoordinatorConfig(scheduler={"policy": "least_load", **scheduler})
    tokenizers = TokenizerCache({}, load_tokenizer)
    picker = EndpointPicker(config, table, WorkloadLedger(), config.scheduler.build(), tokenizers, matcher)
    picker.ledger.commit("d0", 0, 500, 500, 0)
    return picker


async def test_the_decode_instance_is_chosen_by_the_configured_decode_policy():
    by_load = decode_picker()
    assert by_load.decode_policy.name == "least_load"  # the default: as before the seam
    assert (
        await by_load.decide("completions", body(prompt="x"), "a")
    ).target.instance.info.instance_id == "d1"
    in_turn = decode_picker(decode_policy="round_robin")
    d = await in_turn.decide("completions", body(prompt="x"), "a")
    assert (
        d.mode == PdMode.HANDOFF and d.target.instance.info.instance_id == "d0"
    )  # first in turn, busy or not


async def test_a_kv_aware_decode_policy_sees_the_conductors_facts_for_the_decode_pool():
    matcher = RecordingMatcher("d0")
    picker = decode_picker(matcher, decode_policy="kv_affinity", kv_affinity={"mode": "prefix"})
    d = await picker.decide("completions", body(prompt="x " * 100), "a")
    assert matcher.asked == [["d0", "d1"]]
    assert d.target.instance.info.instance_id == "d0" and d.target.match.npu_blocks == 4
    by_load = decode_picker(RecordingMatcher("d0"))
    await by_load.decide("completions", body(prompt="x " * 100), "b")
    assert by_load.matcher.asked == []  # least load asks the conductor nothing


# -- the joint P/D choice (scheduler.pd_choice) --------------------------------------------------------------------


def pair_picker(choice: str) -> EndpointPicker:
    """Handoff instances of model `m` on two nodes: `p1`, `d1` on n1 and `p2`, `d2` on n2; `p1` is busy."""
    table = InstanceTable(["m"])
    for iid, role, node in (("p1", "prefill", "n1"), ("d1", "decode", "n1"), ("p2", "prefill", "n2"),
                            ("d2", "decode", "n2")):  # fmt: skip
        table.register(InstanceInfo(iid, "m", "127.0.0.1:1", role, "handoff", node_id=node))
    config = CoordinatorConfig(scheduler={"policy": "least_load", "pd_choice": choice})
    picker = EndpointPicker(
        config, table, WorkloadLedger(), config.scheduler.build(), TokenizerCache({}, load_tokenizer)
    )
    picker.ledger.commit("p1", 20_000, 0, 20_000, 0)
    return picker


async def test_the_joint_choice_pairs_the_idle_prefill_instance_with_a_decode_instance_on_its_node():
    picker = pair_picker("joint")
    pick = await picker.decide("completions", body(prompt="x " * 500), "a")
    assert pick.mode == PdMode.HANDOFF and pick.target.instance.info.instance_id == "d2"
    assert pick.planned.prefill.instance_id == "p2" and not pick.planned.cross_node
    (kept,) = picker.decisions.recent()  # the decision log: one joint choice, prefill then decode
    assert (kept.stage, kept.policy, kept.chosen) == ("pair", "pd_joint", ("p2", "d2"))
    assert kept.predicted_ttft_s == pick.planned.ttft_s and len(kept.candidates) == 4
    leg = await picker.pick_prefill(pick, set())
    assert leg.instance.info.instance_id == "p2"
    assert picker.ledger.prefill_tokens("p2") == pick.request.prompt_tokens  # committed when sent
    retry = await picker.pick_prefill(pick, {"p2"})  # the planned one failed: the best other for d2
    assert retry.instance.info.instance_id == "p1" and pick.planned.cross_node


async def test_a_trigger_callback_chooses_the_prefill_instance_on_the_ledger_of_its_time_not_the_plan():
    picker = pair_picker("joint")
    picker.config.pd_mode = PdMode.TRIGGER
    first = await picker.decide("completions", body(prompt="x " * 500), "a")
    second = await picker.decide("completions", body(prompt="x " * 500), "b")
    assert first.mode == second.mode == PdMode.TRIGGER
    assert first.planned.prefill.instance_id == second.planned.prefill.instance_id == "p2"  # both at arrival
    leg = await picker.pick_prefill(first, set())  # the first callback
    assert leg.instance.info.instance_id == "p2"
    picker.ledger.commit("p2", 40_000, 0, 40_000, 0)  # p2 got busier than p1 before the second callback
    assert (await picker.pick_prefill(second, set())).instance.info.instance_id == "p1"


async def test_adaptive_serves_a_short_prompt_on_a_decode_instance_alone():
    picker = pair_picker("adaptive")
    for iid in ("d1", "d2"):  # decode instances with sequences running
        picker.ledger.commit(iid, 0, 2000, 4000, 0)
    short = await picker.decide("completions", body(prompt="hi"), "s")
    assert short.mode == PdMode.AGGREGATED and short.planned.prefill is None
    iid = short.target.instance.info.instance_id
    assert iid in ("d1", "d2") and picker.ledger.prefill_tokens(iid) == short.request.prompt_tokens
    long = await picker.decide("completions", body(prompt="x " * 3000), "l")
    assert long.mode == PdMode.HANDOFF and long.planned.prefill.instance_id == "p2"


async def test_separate_choice_is_the_default_and_plans_nothing():
    picker = decode_picker()
    assert picker.pair is None
    assert (await picker.decide("completions", body(prompt="x"), "a")).planned is None
