"""The fleet simulator's pure logic: determinism, the lazy block pool, prompts and trace tiling."""

from __future__ import annotations

import gc
import math

import pytest

from bench.fleet.instance import EngineSpec, LazyBlockPool, RememberingHasher
from bench.fleet.runs import Workload, collector_paused, run_many
from bench.fleet.sim import REPLICATION_EVERY, Fleet, FleetConfig, simulate
from bench.fleet.workload import HASH_STRIDE, PromptSource, arrivals
from simengine.block_hash import BlockHasher
from simengine.block_pool import BlockPool
from simengine.events import EventSink
from tandem.tokenizer import load_tokenizer

ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 100, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 3]},
    {"timestamp": 150, "input_length": 700, "output_length": 6, "hash_ids": [4, 5]},
    {"timestamp": 400, "input_length": 1600, "output_length": 3, "hash_ids": [0, 1, 3, 6]},
    {"timestamp": 420, "input_length": 600, "output_length": 8, "hash_ids": [4, 7]},
]


@pytest.fixture(scope="module")
def word_ids() -> list[int]:
    return load_tokenizer(None).word_ids


def _run(policy: str, word_ids, copies: int = 1, instances: int = 2):
    cfg = FleetConfig(
        instances=instances, policy=policy, engine=EngineSpec(npu_blocks=512), load_interval_s=0.5
    )
    return simulate(cfg, arrivals(ROWS, 1.0, copies, seed=3), word_ids, seed=3)


@pytest.mark.parametrize("policy", ["round_robin", "kv_affinity", "dynamo", "llm_d", "sglang_cache_aware"])
def test_same_seed_same_figures(policy, word_ids):
    a, b = _run(policy, word_ids), _run(policy, word_ids)
    assert a.ttft_s == b.ttft_s and a.e2e_s == b.e2e_s
    assert (a.hits, a.queries, a.output_tokens) == (b.hits, b.queries, b.output_tokens)
    assert len(a.ttft_s) == len(ROWS) and a.output_tokens == sum(r["output_length"] for r in ROWS)


def test_replication_is_sampled_only_where_asked(word_ids):
    """Round robin puts prompts sharing their first two 512-token blocks on both instances: the sample sees those
    held twice (and the rest once); a run that does not ask skips the pass over every cache."""
    rows = [
        {"timestamp": 100 * i, "input_length": 1100, "output_length": 2, "hash_ids": [0, 1, 2 + i]}
        for i in range(REPLICATION_EVERY)
    ]
    runs = [
        simulate(
            FleetConfig(
                instances=2,
                policy="round_robin",
                engine=EngineSpec(npu_blocks=512),
                sample_replication=asked,
            ),
            arrivals(rows, 1.0, seed=3),
            word_ids,
            seed=3,
        )
        for asked in (True, False)
    ]
    assert 0 < runs[0].replicated < 1
    assert math.isnan(runs[1].replicated)
    assert runs[0].ttft_s == runs[1].ttft_s


def test_shared_prefixes_hit_and_ledger_drains(word_ids):
    cfg = FleetConfig(
        instances=1, policy="kv_affinity", engine=EngineSpec(npu_blocks=512), load_interval_s=0.5
    )
    fleet = Fleet(cfg)
    commitments, in_flight = [], []
    commit = fleet.ledger.commit
    fleet.ledger.commit = lambda *args: commitments.append(commit(*args)) or commitments[-1]
    fleet_result = fleet.run(
        arrivals(ROWS, 1.0, seed=3),
        PromptSource(word_ids, seed=3),
        progress=lambda _: in_flight.append(fleet.ledger.total_requests),
    )
    # Rows 2 and 4 reuse 2 and 3 leading 512-token blocks of earlier prompts on the only instance.
    assert fleet_result.hits >= (2 + 3) * 512
    assert 0 < fleet_result.hit_rate < 1
    # One commitment per request: its output, and its prompt less the prefix the index found cached there.
    assert [c.decode_tokens for c in commitments] == [r["output_length"] for r in ROWS]
    prefill = [c.prefill_tokens for c in commitments]
    assert prefill[0] == ROWS[0]["input_length"]
    # Row 4 extends row 2's prompt (hash ids 0, 1, 3): all of row 2's full 16-token engine blocks are cached.
    bs = cfg.engine.block_size
    assert prefill[3] == ROWS[3]["input_length"] - ROWS[1]["input_length"] // bs * bs
    assert all(0 < p <= r["input_length"] for p, r in zip(prefill, ROWS, strict=True))
    # Requests overlapped in the ledger, each finished one was released, and the ledger drained to zero.
    assert max(in_flight) > 0 and in_flight[-1] == 0 and all(c.released for c in commitments)
    assert fleet.ledger.total_tokens == 0 and fleet.ledger.requests("sim-0") == 0


def test_copies_are_disjoint_and_keep_copy_zero(word_ids):
    one, three = arrivals(ROWS, 2.0, 1), arrivals(ROWS, 2.0, 3, seed=1)
    assert len(three) == 3 * len(ROWS)
    assert [a for a in three if a.key < len(ROWS)] == one
    assert one[1].at_s == pytest.approx(0.05)
    ids = {a.key // len(ROWS): {h // HASH_STRIDE for h in a.hash_ids} for a in three}
    assert ids == {0: {0}, 1: {1}, 2: {2}}


def test_a_generated_workload_follows_its_seed():
    """`bench.fleet rows --trace tenants_rag --seed N` replays the workload generated with seed N (it replayed seed 0's
    whatever N was)."""
    one, seven = Workload("tenants_rag", 40, seed=1), Workload("tenants_rag", 40, seed=7)
    assert [a.hash_ids for a in one.arrivals()] == [a.hash_ids for a in one.arrivals()]
    assert [a.hash_ids for a in one.arrivals()] != [a.hash_ids for a in seven.arrivals()]


def test_prompt_text_round_trips_and_blocks_repeat(word_ids):
    tok = load_tokenizer(None)
    src = PromptSource(word_ids, seed=0)
    a, b = arrivals(ROWS, 1.0)[:2]
    pa, pb = src.tokens(a), src.tokens(b)
    assert len(pa) == a.input_len and pa[:1024] == pb[:1024] and pa[1024:1100] != pb[1024:1100]
    assert tok.encode(tok.decode(pa)) == pa


def test_lazy_pool_allocates_in_the_order_of_the_eager_pool():
    eager, lazy = BlockPool(6, 16, EventSink(False)), LazyBlockPool(6, 16, EventSink(False))
    for pool in (eager, lazy):
        first = pool.get_new_blocks(4)
        pool.free_blocks(list(reversed(first[:2])))
        assert pool.num_free_blocks == 4
    order = [[b.block_id for b in pool.get_new_blocks(4)] for pool in (eager, lazy)]
    assert (
        order[0] == order[1] == [1, 0, 4, 5]
    )  # freed uncached blocks first (vLLM 0.32), then never-used ones
    assert eager.usage() == lazy.usage() == 1.0


def test_remembering_hasher_gives_vllms_digests_and_forgets_past_its_limit():
    plain, remembering = BlockHasher(), RememberingHasher(limit=3)
    blocks = [
        (None, list(range(16)), None),
        (b"p" * 32, [7] * 16, (("cache_salt", "s"),)),
        (None, [1] * 16, None),
    ]
    for _ in range(2):  # the second pass answers from memory
        for parent, tokens, extra in blocks:
            assert remembering.hash_block(parent, tokens, extra) == plain.hash_block(parent, tokens, extra)
    assert len(remembering._memo) == 3
    assert remembering.hash_block(None, [2] * 16) == plain.hash_block(None, [2] * 16)
    assert len(remembering._memo) == 1  # full: forgotten at once, then the new block remembered


def _collector_state(_job) -> bool:
    return gc.isenabled()


def _fail(_job):
    raise RuntimeError("boom")


def test_simulations_run_with_the_cyclic_collector_paused_and_restore_it():
    assert gc.isenabled()
    assert run_many([1, 2], workers=1, run=_collector_state) == [False, False]
    assert run_many([1, 2], workers=2, run=_collector_state) == [False, False]  # in the pool's processes too
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        collector_paused(_fail, 0)
    assert gc.isenabled()
    gc.disable()
    try:  # a caller that paused it itself gets it back paused
        assert collector_paused(_collector_state, 0) is False
        assert not gc.isenabled()
    finally:
        gc.enable()


def _signal_run(word_ids, signal, faults=None, rate=4.0):
    from bench.fleet.sim import Faults  # noqa: F401 - faults built by callers

    rows = [
        {
            "timestamp": i * 40,
            "input_length": 900 + 37 * (i % 7),
            "output_length": 8,
            "hash_ids": [i % 3, 100 + i],
        }
        for i in range(120)
    ]
    cfg = FleetConfig(
        instances=2,
        policy="least_load",
        engine=EngineSpec(npu_blocks=512),
        signal=signal,
        load_interval_s=0.25,
        faults=faults,
    )
    return simulate(cfg, arrivals(rows, rate), word_ids, seed=1)


def test_counter_signal_follows_the_true_queued_prefill(word_ids):
    end, counter, exact = (_signal_run(word_ids, s) for s in ("end", "counter", "first_token"))
    assert exact.signal_error == pytest.approx(0.0)
    assert counter.signal_error < end.signal_error
    assert end.signal_ratio > 1.1  # prompts long since decoding still counted
    for r in (end, counter, exact):
        assert r.residual_tokens == 0 and r.residual_requests == 0


def test_signal_survives_aborts_engine_and_coordinator_restarts(word_ids):
    from bench.fleet.sim import Faults

    faults = Faults(
        abort_share=0.2, abort_within_s=0.5, engine_restarts=((0.6, 1),), coordinator_restarts=(0.9,)
    )
    r = _signal_run(word_ids, "counter", faults)
    assert r.residual_tokens == 0 and r.residual_requests == 0
    assert r.signal_error < 0.5


def test_peers_use_their_real_systems_signals():
    # Dynamo's router releases prefill at the first token; llm-d's picker refreshes metrics every 50 ms.
    assert FleetConfig(policy="dynamo").effective_signal == "first_token"
    assert FleetConfig(policy="llm_d").effective_load_interval_s == 0.05
    tandem = FleetConfig(policy="kv_affinity")
    assert (tandem.effective_signal, tandem.effective_load_interval_s) == ("counter", 0.25)
    assert FleetConfig(policy="dynamo", signal="counter").effective_signal == "counter"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"load_weigth": 1}', "--kv-params: kv_affinity.load_weigth: unknown parameter"),
        ("{load", "--kv-params: Expecting property name"),
    ],
)
def test_routing_names_a_bad_kv_affinity_variant_before_running(value, message):
    from bench.fleet.__main__ import main

    with pytest.raises(SystemExit, match=message):
        main(["routing", "--kv-params", value, "--workloads", "tenants_rag", "--cache-sizes", "2048"])
