"""The joint (prefill, decode) choice: predicted TTFT with transfer cost, KV room, and local serving."""

from __future__ import annotations

import pytest

from coordinator.latency import StepCosts
from coordinator.scheduling.pd_joint import PdJoint, create, prefill_s
from coordinator.topology import PRESETS, Link, NodeLinks, Topology
from tests.coordinator.scheduling.fakes import cand

COSTS = StepCosts(step=0.01, prefill=1e-4, decode=1e-4, context=0.0)
ISL = 4096


def p(iid: str, node: str = "n1", **kw):
    c = cand(iid, role="prefill", node=node, **kw)
    return type(c)(c.state, c.prefill_tokens, c.decode_tokens, c.inflight, c.context_tokens, c.match, COSTS)


def d(iid: str, node: str = "n1", **kw):
    c = cand(iid, role="decode", node=node, **kw)
    return type(c)(c.state, c.prefill_tokens, c.decode_tokens, c.inflight, c.context_tokens, c.match, COSTS)


def test_the_prefill_instance_with_the_prompt_cached_wins_until_its_queue_costs_more():
    joint = create()
    choice = joint.choose(ISL, [p("p0", npu=200), p("p1")], [d("d0")])  # 3,200 of 4,096 tokens cached on p0
    assert choice.prefill.instance_id == "p0"
    choice = joint.choose(ISL, [p("p0", npu=200, prefill=8000), p("p1")], [d("d0")])
    assert choice.prefill.instance_id == "p1"


def test_prefill_time_is_the_queue_and_the_uncached_prompt_in_steps_of_the_budget():
    # 4,096 uncached tokens behind 8,000 queued: 12,096 tokens, two steps of the default 8,192-token budget.
    expected = 2 * COSTS.step + 12_096 * COSTS.prefill
    assert prefill_s(p("p0", prefill=8000), ISL) == pytest.approx(expected)
    assert create().prefill_s(p("p0", prefill=8000), ISL) == pytest.approx(expected)
    assert prefill_s(p("p0", prefill=8000), ISL, step_budget=4096) > expected  # more, smaller steps


def test_a_decode_instance_on_the_prefill_node_wins_over_one_across_the_network():
    joint = create()
    choice = joint.choose(ISL, [p("p0", node="n1")], [d("d-far", node="n2"), d("d-near", node="n1")])
    assert (choice.decode.instance_id, choice.cross_node) == ("d-near", False)
    far = joint.transfer(p("p0", node="n1"), d("d-far", node="n2"), ISL)
    near = joint.transfer(p("p0", node="n1"), d("d-near", node="n1"), ISL)
    nbytes = ISL * 131072
    assert far == (pytest.approx(50e-6 + nbytes / 25e9), ISL, True)  # Ascend RoCE, 25 GB/s
    assert near == (pytest.approx(20e-6 + nbytes / 56e9), ISL, False)  # HCCS, 56 GB/s


def test_blocks_the_decode_instance_holds_are_not_moved():
    joint = create()
    seconds, tokens, _ = joint.transfer(p("p0"), d("d0", npu=100), ISL)
    assert tokens == ISL - 1600


def test_transfers_in_flight_share_the_link_until_their_predicted_end():
    now = [0.0]
    joint = PdJoint(topology=Topology(), clock=lambda: now[0])
    alone, _, _ = joint.transfer(p("p0", node="n1"), d("d0", node="n2"), ISL)
    for _ in range(2):
        joint.sent(joint.choose(ISL, [p("p1", node="n3")], [d("d1", node="n2")]))  # into n2's NIC
    shared, _, _ = joint.transfer(p("p0", node="n1"), d("d0", node="n2"), ISL)
    assert shared - 50e-6 == pytest.approx(3 * (alone - 50e-6))
    assert joint.transfers.in_flight(now[0]) == 4  # two transfers, each on two NICs
    now[0] = 10.0
    assert joint.transfers.in_flight(now[0]) == 0


def test_a_decode_instance_without_free_kv_is_never_chosen():
    joint = create()
    choice = joint.choose(ISL, [p("p0")], [d("d-full", kv_usage=0.97, node="n1"), d("d-room", node="n2")])
    assert choice.decode.instance_id == "d-room"  # even across nodes
    # every decode instance full: the least full ones still serve (vLLM queues the request)
    choice = joint.choose(ISL, [p("p0")], [d("d1", kv_usage=0.99), d("d2", kv_usage=0.97)])
    assert choice.decode.instance_id == "d2"


def test_adaptive_serves_short_prompts_locally_and_long_ones_disaggregated():
    adaptive = create(local=True)
    busy = d("d0", inflight=32, context=32 * 1000)
    short = adaptive.choose(64, [p("p0")], [busy])
    assert short.prefill is None and short.transfer_tokens == 0
    long = adaptive.choose(ISL, [p("p0")], [busy])  # its 32 sequences would each wait ~0.4 s
    assert long.prefill is not None and long.prefill.instance_id == "p0"
    assert create().choose(64, [p("p0")], [busy]).prefill is not None  # pd_joint alone always disaggregates


def test_adaptive_serves_locally_when_the_prefill_pool_is_saturated_and_a_decoder_is_idle():
    adaptive = create(local=True)
    choice = adaptive.choose(ISL, [p("p0", prefill=60_000), p("p1", prefill=60_000)], [d("d0")])
    assert choice.prefill is None and choice.decode.instance_id == "d0"


def test_adaptive_does_not_serve_locally_where_the_prefill_would_stall_decoding_past_the_itl_bound():
    """The pool is saturated, so serving on d0 is predicted sooner, but its 4 sequences would wait ~0.42 s for
    their next token while the step carries a 4,096-token prefill: past the 50 ms bound, so the request is
    disaggregated; without a bound (0) it is served locally, and with no prefill instance at all it is too."""
    saturated = [p("p0", prefill=60_000), p("p1", prefill=60_000)]
    decoding = d("d0", inflight=4, context=4 * 1000)
    adaptive = create(local=True)
    assert adaptive.local_gap_s(decoding, ISL) == pytest.approx(0.4096 + COSTS.step_s(4, 1000.0))
    assert adaptive.choose(ISL, saturated, [decoding]).prefill is not None
    assert create({"itl_bound_s": 0}, local=True).choose(ISL, saturated, [decoding]).prefill is None
    assert adaptive.choose(ISL, [], [decoding]).prefill is None
    assert adaptive.local_gap_s(d("d1"), ISL) == 0.0  # nothing decodes there: no one waits


def test_without_a_policy_every_pair_is_scored():
    joint = create()
    prefills = [p(f"p{i}", prefill=1000 * i) for i in range(6)]
    decodes = [d(f"d{i}", inflight=i, context=500 * i) for i in range(6)]
    seen: list[tuple[str, str]] = []
    original = PdJoint.transfer

    def counting(self, pc, dc, isl):
        seen.append((pc.instance_id, dc.instance_id))
        return original(self, pc, dc, isl)

    PdJoint.transfer = counting  # type: ignore[method-assign]
    try:
        choice = joint.choose(ISL, prefills, decodes)
    finally:
        PdJoint.transfer = original  # type: ignore[method-assign]
    assert seen == [(f"p{i}", f"d{j}") for i in range(6) for j in range(6)]
    assert (choice.prefill.instance_id, choice.decode.instance_id) == ("p0", "d0")


def test_a_node_can_override_its_links():
    slow = NodeLinks(intra=Link(1e9), nic=Link(1e9))
    topo = Topology({"n9": slow}, default=PRESETS["gpu"])
    assert topo.link("n9", "n9") == (Link(1e9), ("n9",))
    link, keys = topo.link("n1", "n9")
    assert link.bandwidth == 1e9 and keys == ("n1/nic", "n9/nic")


def test_bad_parameters_are_named():
    with pytest.raises(ValueError, match="max_kv_usage"):
        create({"max_kv_usage": 1.5})
    with pytest.raises(ValueError, match="itl_bound_s"):
        create({"itl_bound_s": -1})
    with pytest.raises(ValueError, match="choose needs at least one decode candidate"):
        create().choose(ISL, [p("p0")], [])


def test_a_prefill_instance_for_a_decode_instance_already_chosen_counts_the_transfer_to_it():
    joint = create(local=True)
    far, near = p("p-far", node="n2"), p("p-near", node="n1")
    choice = joint.prefill_for(ISL, [far, near], d("d0", node="n1", inflight=30, context=30_000))
    assert choice.prefill.instance_id == "p-near" and not choice.cross_node  # never local, even adaptive
    with pytest.raises(ValueError, match="prefill_for needs"):
        joint.prefill_for(ISL, [], d("d0"))


def lora(c, adapters=(), active=(), max_loras=2):
    c.state.load.adapters, c.state.load.active_adapters = frozenset(adapters), frozenset(active)
    c.state.load.max_loras = max_loras
    return c


def test_both_legs_of_a_lora_request_are_chosen_with_the_adapter_in_mind():
    joint = create()
    ps = [lora(p("p0"), ["sql"]), lora(p("p1"))]
    ds = [lora(d("d0")), lora(d("d1"), ["sql"])]
    choice = joint.choose(ISL, ps, ds, adapter="sql")
    assert (choice.prefill.instance_id, choice.decode.instance_id) == ("p0", "d1")
    assert joint.choose(ISL, ps, ds).prefill.instance_id == "p0"  # base model: ties to the ids in order
    assert joint.choose(ISL, ps, ds).decode.instance_id == "d0"
    # A holder much busier than the load costs loses to loading the adapter elsewhere.
    busy = [lora(p("p0", prefill=20000), ["sql"]), lora(p("p1"))]
    assert joint.choose(ISL, busy, ds, adapter="sql").prefill.instance_id == "p1"
    # A decode instance whose slots are all busy waits longer than one that loads it.
    full = [lora(d("d0"), ["a", "b"], active=["a", "b"]), lora(d("d1"), ["a"], active=["a"])]
    assert joint.choose(ISL, ps, full, adapter="sql").decode.instance_id == "d1"


def transfers(c, ok: int, failed: int):
    c.state.load.kv_transfers, c.state.load.kv_transfer_failures = ok, failed
    return c


def test_a_pair_whose_transfer_failed_comes_after_every_other_choice_for_the_cooldown():
    now = [0.0]
    joint = PdJoint(topology=Topology(), clock=lambda: now[0])
    near, far = p("p-near", node="n1"), p("p-far", node="n2")
    assert joint.choose(ISL, [near, far], [transfers(d("d0", node="n1"), 0, 0)]).prefill is near
    joint.sent(joint.choose(ISL, [near, far], [transfers(d("d0", node="n1"), 0, 0)]))
    now[0] = 1.0  # d0's pull from p-near failed: its heartbeat counts it, and d0 recomputed the prompt
    choice = joint.choose(ISL, [near, far], [transfers(d("d0", node="n1"), 0, 1)])
    assert choice.prefill is far  # across nodes, slower, but not the failing link
    assert joint.prefill_for(ISL, [near, far], transfers(d("d0", node="n1"), 0, 1)).prefill is far
    # Adaptive: serving on the decode instance alone beats the failing pair too.
    adaptive = PdJoint(topology=Topology(), local=True, clock=lambda: now[0])
    adaptive.links = joint.links
    assert adaptive.choose(ISL, [near], [transfers(d("d0", node="n1"), 0, 1)]).prefill is None
    # With nothing else, the failing pair is still used (the decode engine recomputes), and retried later.
    assert joint.choose(ISL, [near], [transfers(d("d0", node="n1"), 0, 1)]).prefill is near
    now[0] = 1.0 + joint.params.link_cooldown_s + 0.1
    assert joint.choose(ISL, [near, far], [transfers(d("d0", node="n1"), 0, 1)]).prefill is near
    with pytest.raises(ValueError, match="link_cooldown_s"):
        create({"link_cooldown_s": -1})


def test_with_the_policys_prefill_pick_the_decode_instance_is_chosen_for_it():
    joint = create()
    by_policy = p("p-owner", node="n2")  # say the policy keeps the prefix where it lives, on n2
    picked: list[list[str]] = []

    def pick(cands):
        picked.append([c.instance_id for c in cands])
        return next(c for c in cands if c.instance_id == "p-owner")

    choice = joint.choose(
        ISL,
        [p("p-idle", node="n1"), by_policy],
        [d("d-n1", node="n1"), d("d-n2", node="n2")],
        prefill_pick=pick,
    )
    assert (choice.prefill.instance_id, choice.decode.instance_id, choice.cross_node) == (
        "p-owner",
        "d-n2",
        False,
    )
    assert picked == [["p-idle", "p-owner"]]


def test_the_policy_is_not_offered_a_prefill_instance_whose_every_link_failed():
    now = [0.0]
    joint = PdJoint(topology=Topology(), clock=lambda: now[0])
    for decode in ("d0", "d1"):
        joint.links.observe(decode, 0, 0, now=0.0)
        joint.links.sent("p-broken", decode, now=0.0)
        joint.links.observe(decode, 0, 1, now=0.5)
    offered: list[list[str]] = []

    def pick(cands):
        offered.append([c.instance_id for c in cands])
        return cands[0]

    decodes = [transfers(d("d0"), 0, 1), transfers(d("d1"), 0, 1)]
    assert (
        joint.choose(ISL, [p("p-broken"), p("p-ok")], decodes, prefill_pick=pick).prefill.instance_id
        == "p-ok"
    )
    assert joint.choose(ISL, [p("p-broken")], decodes, prefill_pick=pick).prefill.instance_id == "p-broken"
    assert offered == [["p-ok"], ["p-broken"]]  # with nothing else, the failing one is still used
