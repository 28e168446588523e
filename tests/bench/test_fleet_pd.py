"""The fleet simulator's P/D model: links shared by concurrent transfers, trigger's layer-by-layer overlap, decode
KV capacity, handoff and trigger timing, and every P/D rule returning valid pairs. Virtual time only: no run here
sleeps or depends on the machine's speed."""

from __future__ import annotations

import pytest

from bench.fleet.instance import EngineSpec
from bench.fleet.links import Links, Topology
from bench.fleet.pd import PdConfig, PdFleet, PdResult, best, refine, simulate_pd, splits, spread, suggest
from bench.fleet.pd_rules import RULES, PdView, create_rule
from bench.fleet.workload import PromptSource, arrivals
from coordinator.instances import InstanceInfo, InstanceState
from coordinator.scheduling import Candidate, KvMatch, RequestFacts
from tandem.tokenizer import load_tokenizer

GB = 1e9
TOPO = Topology(
    nodes=2, nic_bandwidth=10 * GB, nic_latency_s=0.0, intra_bandwidth=40 * GB, intra_latency_s=0.0
)

ROWS = [
    {
        "timestamp": i * 150,
        "input_length": 1100 + 200 * (i % 3),
        "output_length": 4 + i % 3,
        "hash_ids": [0, 1, i + 2],
    }
    for i in range(12)
]


@pytest.fixture(scope="module")
def word_ids() -> list[int]:
    return load_tokenizer(None).word_ids


def _drain(links: Links, limit: int = 100) -> None:
    """Advances the links event by event until nothing moves (bounded)."""
    for _ in range(limit):
        at = links.next_time()
        if at is None:
            return
        links.advance(at)
    raise AssertionError("links never settled")


def test_one_transfer_takes_bytes_over_bandwidth_plus_latency():
    links = Links(Topology(nodes=2, nic_bandwidth=10 * GB, nic_latency_s=0.001))
    done = []
    links.start(0.0, 0, 1, 5 * GB, on_done=done.append)
    _drain(links)
    assert done == [pytest.approx(0.5 + 0.001)]
    assert links.bytes_inter_node == 5 * GB and links.bytes_intra_node == 0


def test_concurrent_transfers_share_a_nic():
    links = Links(TOPO)
    done: dict[str, float] = {}
    links.start(0.0, 0, 1, 5 * GB, on_done=lambda t: done.setdefault("a", t))
    links.start(0.0, 0, 1, 5 * GB, on_done=lambda t: done.setdefault("b", t))
    _drain(links)
    # Alone each would take 0.5 s; together they share 10 GB/s and both end at 1 s.
    assert done["a"] == pytest.approx(1.0) and done["b"] == pytest.approx(1.0)


def test_a_transfer_speeds_up_when_the_other_ends():
    links = Links(TOPO)
    done: dict[str, float] = {}
    links.start(0.0, 0, 1, 2 * GB, on_done=lambda t: done.setdefault("short", t))
    links.start(0.0, 0, 1, 6 * GB, on_done=lambda t: done.setdefault("long", t))
    _drain(links)
    # Both at 5 GB/s until the short one ends at 0.4 s (2 GB); the long one has 4 GB left, alone at 10 GB/s.
    assert done["short"] == pytest.approx(0.4) and done["long"] == pytest.approx(0.8)


def test_intra_node_transfers_do_not_use_the_nic():
    links = Links(TOPO)
    done: dict[str, float] = {}
    links.start(0.0, 0, 0, 4 * GB, on_done=lambda t: done.setdefault("intra", t))
    links.start(0.0, 0, 1, 5 * GB, on_done=lambda t: done.setdefault("inter", t))
    _drain(links)
    assert done["intra"] == pytest.approx(0.1) and done["inter"] == pytest.approx(0.5)
    assert links.bytes_intra_node == 4 * GB and links.bytes_inter_node == 5 * GB


def test_trigger_transfer_overlaps_the_prefill_and_waits_for_its_last_layer():
    links = Links(TOPO)
    done = []
    t = links.start(0.0, 0, 1, 3.2 * GB, layers=32, on_done=done.append)  # 0.32 s of link time
    links.advance(1.0)  # the prefill computes for 1 s: everything but the last layer has left meanwhile
    assert done == [] and t.remaining == pytest.approx(0.1 * GB)
    links.produced(1.0, t)
    _drain(links)
    assert done == [pytest.approx(1.01)]  # the last layer only: 0.1 GB at 10 GB/s after the prefill's end


def test_topology_rejects_bad_values():
    with pytest.raises(ValueError, match="topology.nodes"):
        Topology(nodes=0)
    with pytest.raises(ValueError, match="topology.nic_bandwidth"):
        Topology(nic_bandwidth=0)


def test_roles_are_spread_over_nodes():
    assert spread(2, 4, Topology(2)) == [0, 2]
    assert spread(4, 8, Topology(2)) == [0, 1, 4, 5]
    assert splits(4) == [1, 2, 3] and splits(8) == [2, 4, 6] and refine(8, [2, 4, 6], 4) == [3, 5]


def test_a_split_is_judged_by_requests_within_the_slos_then_mean_ttft():
    """A shorter makespan (a higher goodput) with the same requests within the SLOs does not outrank a lower TTFT."""
    slow = PdResult(prefill=5, ttft_s=[0.5, 0.6], good=2, makespan_s=31.0)
    fast = PdResult(prefill=6, ttft_s=[0.4, 0.4], good=2, makespan_s=32.0)
    assert slow.goodput > fast.goodput and best([slow, fast]) is fast
    more = PdResult(prefill=4, ttft_s=[0.9, 3.0, 0.9], good=3, makespan_s=40.0)
    assert best([slow, fast, more]) is more


def _cfg(rule: str, mode: str = "handoff", **kw) -> PdConfig:
    return PdConfig(4, 2, rule, mode, EngineSpec(npu_blocks=1024), TOPO, load_interval_s=0.25, **kw)


@pytest.mark.parametrize("mode", ["handoff", "trigger"])
def test_every_request_is_answered_in_both_modes(mode, word_ids):
    r = simulate_pd(_cfg("tandem_least_load", mode), arrivals(ROWS, 1.0), word_ids)
    assert len(r.ttft_s) == len(ROWS) and r.disaggregated == len(ROWS) and r.local == 0
    assert len(r.transfer_s) == len(ROWS)
    assert r.bytes_inter_node + r.bytes_intra_node > 0


def test_same_seed_same_figures(word_ids):
    a = simulate_pd(_cfg("dynamo"), arrivals(ROWS, 1.0), word_ids)
    b = simulate_pd(_cfg("dynamo"), arrivals(ROWS, 1.0), word_ids)
    assert a.ttft_s == b.ttft_s and a.itl_s == b.itl_s and a.bytes_inter_node == b.bytes_inter_node


def test_handoff_ttft_includes_prefill_transfer_and_first_decode_step(word_ids):
    """One request alone: TTFT = prefill step + KV transfer + the decode engine's first step."""
    row = [{"timestamp": 0, "input_length": 4096, "output_length": 2, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7]}]
    cfg = _cfg("tandem_least_load")
    fleet = PdFleet(cfg)
    r = fleet.run(arrivals(row, 1.0), PromptSource(word_ids, 0))
    prof = fleet.instances[0].profile
    prefill = prof.step_s([(4096, 0)], 0, 0)
    transfer = 4096 * cfg.kv_bytes_per_token / TOPO.nic_bandwidth  # sim-0 (node 0) to the least-loaded decode
    assert r.transfer_s[0] == pytest.approx(transfer, rel=1e-6) or r.transfer_s[0] == pytest.approx(
        4096 * cfg.kv_bytes_per_token / TOPO.intra_bandwidth, rel=1e-6
    )
    first_decode = prof.step_s([(1, 4095)], 0, 0)
    assert r.ttft_s[0] == pytest.approx(prefill + r.transfer_s[0] + first_decode, rel=1e-6)


def test_trigger_overlaps_transfer_with_prefill(word_ids):
    """The same lone request in trigger mode: the transfer streams while the prefill computes, so TTFT is shorter
    than handoff's by nearly the whole transfer."""
    row = [{"timestamp": 0, "input_length": 8000, "output_length": 2, "hash_ids": list(range(16))}]
    slow = Topology(
        nodes=2, nic_bandwidth=2 * GB, nic_latency_s=0.0, intra_bandwidth=2 * GB, intra_latency_s=0.0
    )
    runs = {}
    for mode in ("handoff", "trigger"):
        cfg = PdConfig(4, 2, "tandem_least_load", mode, EngineSpec(npu_blocks=1024), slow, callback_s=0.0)
        runs[mode] = simulate_pd(cfg, arrivals(row, 1.0), word_ids)
    full = 8000 * PdConfig().kv_bytes_per_token / (2 * GB)
    assert runs["handoff"].ttft_s[0] - runs["trigger"].ttft_s[0] > 0.8 * full


def test_decode_instance_without_free_blocks_keeps_the_request_waiting(word_ids):
    """A decode engine allocates the whole prompt's blocks before any KV moves: with its pool held by another
    request it admits nothing, so no transfer starts until blocks are free."""
    row = [{"timestamp": 0, "input_length": 3000, "output_length": 3, "hash_ids": [0, 1, 2, 3, 4, 5]}]
    cfg = PdConfig(2, 1, "tandem_least_load", "handoff", EngineSpec(npu_blocks=256), TOPO)
    fleet = PdFleet(cfg)
    decode = fleet.by_id[fleet.decode_ids[0]]
    decode.kv.pool.get_new_blocks(decode.kv.pool.num_free_blocks - 10)  # leaves 10 blocks (160 tokens)
    arr = arrivals(row, 1.0)
    fleet.now = arr[0].at_s
    prompts = PromptSource(word_ids, 0)
    fleet._push = lambda *a: None
    fleet._schedule_links = lambda: None
    fleet._live = {}
    fleet._arrive(arr[0], prompts.tokens(arr[0]), True)
    live = next(iter(fleet._live.values()))
    fleet._prefill_done(live, fleet.by_id[live.choice.prefill])  # as if the prefill leg had completed
    assert live.decode_req in decode.scheduler.waiting and not decode.scheduler.remote_waiting
    assert not live.xfer_started and not fleet.links.active


def _candidate(iid: str, inflight: int = 0, matched_blocks: int = 0) -> Candidate:
    info = InstanceInfo(iid, "m", f"sim/{iid}", "hybrid", "aggregated", block_size=16)
    return Candidate(InstanceState(info, registered_at=0.0, last_heartbeat_at=0.0), 100 * inflight, 10 * inflight, inflight, 0,
                     KvMatch(npu_blocks=matched_blocks))  # fmt: skip


def _view(decode_fixed: str | None = None) -> PdView:
    pre = [_candidate("p0", 1, 4), _candidate("p1", 0, 0), _candidate("p2", 3, 8)]
    dec = [_candidate("d0", 2, 0), _candidate("d1", 0, 2), _candidate("d2", 5, 8)]
    node = {"p0": 0, "p1": 1, "p2": 0, "d0": 0, "d1": 1, "d2": 0}
    return PdView(pre, dec, node, {}, {"d0": 10.0, "d1": 0.0, "d2": 30.0}, decode_fixed)


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("isl", [64, 4000])
def test_every_rule_returns_a_valid_pair(name, isl):
    rule = create_rule(name)
    facts = RequestFacts("r1", "m", isl, 8, tuple(range(isl // 16)))
    for _ in range(3):
        choice = rule.decide(facts, _view())
        assert choice.decode in {"d0", "d1", "d2"}
        assert choice.prefill is None or choice.prefill in {"p0", "p1", "p2"}
        if not rule.disaggregates:
            assert choice.prefill is None
    if rule.disaggregates:  # trigger callback: the decode instance is kept and a prefill instance named
        choice = rule.decide(facts, _view(decode_fixed="d2"))
        assert choice.decode == "d2" and choice.prefill in {"p0", "p1", "p2"}


def test_dynamo_and_llm_d_thresholds():
    short = RequestFacts("r", "m", 500, 8)
    long = RequestFacts("r", "m", 5000, 8)
    dynamo = create_rule("dynamo")
    assert dynamo.decide(short, _view()).prefill is None  # 500 uncached tokens <= 1000: local
    assert dynamo.decide(long, _view()).prefill is not None
    assert create_rule("llm_d").decide(short, _view()).prefill is not None  # nonCachedTokens 0: always P/D


def test_tandem_joint_pairs_within_a_node_and_adaptive_keeps_short_prompts_local():
    view = _view()
    long = RequestFacts("r", "m", 5000, 8)
    choice = create_rule("tandem_joint").decide(long, view)
    assert view.node[choice.prefill] == view.node[choice.decode]  # the KV stays on the node's fabric
    assert create_rule("tandem_adaptive").decide(RequestFacts("r", "m", 40, 8), view).prefill is None


def test_unknown_rules_are_refused():
    with pytest.raises(ValueError, match="unknown P/D rule"):
        create_rule("nope")


def test_cli_writes_one_row_per_rule(tmp_path):
    from bench.fleet.__main__ import main

    argv = ["pd", "--trace", "conversation", "--requests", "20", "--instances", "2", "--npu-blocks", "2048"]
    argv += ["--rules", "aggregated", "tandem_least_load", "--workers", "1", "--output-dir", str(tmp_path)]
    assert main(argv) == 0
    text = (tmp_path / "fleet-pd.md").read_text()
    assert (
        "| rule | P:D | suggested | mean | p99 | itl p99 | goodput | bytes across nodes | hit rate |" in text
    )
    rows = [
        line for line in text.splitlines() if line.startswith("| aggregated") or line.startswith("| tandem")
    ]
    assert len(rows) == 2 and rows[1].split("|")[2].strip() == "1:1"
    assert rows[1].split("|")[3].strip() == "1:1"  # two instances: the only split


def test_a_run_measures_its_demand_and_sizes_the_fleet_with_the_coordinators_core(word_ids):
    r = simulate_pd(_cfg("tandem_least_load"), arrivals(ROWS, 1.0), word_ids)
    outputs = [row["output_length"] for row in ROWS]
    assert r.generated == sum(outputs)
    assert r.context_generated == pytest.approx(
        sum(o * (row["input_length"] + o / 2) for o, row in zip(outputs, ROWS, strict=True))
    )
    assert 0 < r.prompt_computed <= sum(row["input_length"] for row in ROWS)
    assert r.arrival_span_s == pytest.approx(11 * 0.150)
    z = r.sizing
    assert (z.prefill, z.decode) == (2, 2) and z.suggested_prefill + z.suggested_decode == 4
    assert z.demand.output_tokens_s == pytest.approx(sum(outputs) / r.arrival_span_s)


def test_the_suggestion_follows_the_demand():
    """Prompt-heavy demand asks for prefill instances, output-heavy demand for decode instances."""
    cfg = PdConfig(8, 4, "tandem_least_load", engine=EngineSpec(npu_blocks=16384))
    prompts = PdResult(prefill=4, prompt_computed=200_000, generated=500, context_generated=500 * 2000.0)
    prompts.arrival_span_s, prompts.queries, prompts.measured = 10.0, 10_000, 5
    assert suggest(cfg, prompts).suggested_prefill >= 6
    outputs = PdResult(prefill=4, prompt_computed=20_000, generated=50_000, context_generated=50_000 * 2000.0)
    outputs.arrival_span_s, outputs.queries, outputs.measured = 10.0, 10_000, 5
    assert suggest(cfg, outputs).suggested_prefill <= 2


def test_cli_refuses_unknown_rules():
    from bench.fleet.__main__ import main

    with pytest.raises(SystemExit, match="is unknown"):
        main(["pd", "--trace", "conversation", "--requests", "5", "--rules", "tandem_jointly"])
