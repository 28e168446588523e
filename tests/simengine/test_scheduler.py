"""Scheduler, sampler and timing model without sockets."""

from simengine.events import EventSink
from simengine.kv_cache_manager import KVCacheManager
from simengine.profiles import ASCEND_910B, H100
from simengine.request import Request, SamplingParams, Status
from simengine.sampler import Sampler, seed_key
from simengine.scheduler import Scheduler

SAMPLER = Sampler(list(range(500, 600)), eos_token_id=2)


def make(blocks=64, seqs=8, budget=64, bs=4, policy="fcfs"):
    kv = KVCacheManager(blocks, bs, EventSink())
    return Scheduler(kv, SAMPLER, seqs, budget, policy)


def req(n, rid, max_tokens=4, ignore_eos=True, key=None, priority=0, arrival=0.0):
    prompt = [(i * 7 + len(rid)) % 400 + 10 for i in range(n)]
    sp = SamplingParams(
        max_tokens=max_tokens, ignore_eos=ignore_eos, seed_key=key or seed_key(prompt, 0, 1, -1, None, 0)
    )
    return Request(rid, prompt, sp, arrival, priority=priority)


def run(s: Scheduler, limit=1000):
    steps = []
    while s.has_work and limit:
        out = s.schedule()
        steps.append(out)
        s.update(out)
        limit -= 1
    return steps


def test_continuous_batching_runs_everything_to_length():
    s = make()
    reqs = [req(10, f"r{i}") for i in range(5)]
    for r in reqs:
        s.add_request(r)
    steps = run(s)
    assert all(r.status is Status.FINISHED_LENGTH and len(r.output_token_ids) == 4 for r in reqs)
    assert steps[0].prefill_chunks and any(st.num_decode == 5 for st in steps)
    assert s.kv.usage() == 0.0


def test_chunked_prefill_respects_budget():
    s = make(budget=16)
    r = req(40, "long")
    s.add_request(r)
    first = s.schedule()
    assert first.scheduled == [(r, 16)]
    s.update(first)
    assert r.num_computed_tokens == 16 and not r.output_token_ids
    run(s)
    assert len(r.output_token_ids) == 4


def test_max_num_seqs_limits_running():
    s = make(seqs=2)
    for i in range(4):
        s.add_request(req(4, f"r{i}"))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_preemption_when_cache_is_full():
    s = make(blocks=6, budget=256, bs=4)
    a, b = req(8, "a", max_tokens=12), req(8, "b", max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    steps = run(s)
    assert s.num_preemptions >= 1 and any(st.preempted for st in steps)
    assert len(a.output_token_ids) == 12 and len(b.output_token_ids) == 12


def test_priority_policy_orders_waiting_by_priority_then_arrival():
    s = make(seqs=1, policy="priority")
    reqs = [req(4, "late-low", priority=1, arrival=1.0), req(4, "high", priority=-1, arrival=3.0),
            req(4, "early-low", priority=1, arrival=0.5), req(4, "mid", priority=0, arrival=2.0)]  # fmt: skip
    for r in reqs:
        s.add_request(r)
    assert [r.request_id for r in s.waiting] == ["high", "mid", "early-low", "late-low"]
    order = []
    while s.has_work:
        out = s.schedule()
        order += [r.request_id for r, _ in out.scheduled if r.request_id not in order]
        s.update(out)
    assert order == ["high", "mid", "early-low", "late-low"]
    fcfs = make(seqs=1)
    for r in [req(4, "a", priority=5), req(4, "b", priority=-5)]:
        fcfs.add_request(r)
    assert [r.request_id for r in fcfs.waiting] == ["a", "b"]  # fcfs ignores priority


def test_priority_policy_preempts_the_largest_priority_not_the_latest():
    # Three requests fill the cache; when one must grow, vLLM's priority rule evicts the running request with the
    # largest (priority, arrival), here the first admitted, where fcfs would evict the last admitted.
    def scenario(policy):
        s = make(blocks=6, budget=256, bs=4, policy=policy)
        low = req(4, "low", max_tokens=12, priority=2, arrival=0.0)
        mid = req(4, "mid", max_tokens=12, priority=1, arrival=1.0)
        high = req(4, "high", max_tokens=12, priority=0, arrival=2.0)
        for r in (low, mid, high):
            s.add_request(r)
        while s.has_work:
            out = s.schedule()
            if out.preempted:
                return [r.request_id for r in out.preempted], s
            s.update(out)
        raise AssertionError("no preemption")

    victims, s = scenario("priority")
    assert victims[0] == "low" and s.waiting[0].request_id == "low"
    assert all(r.request_id != "low" for r in s.running)
    victims, _ = scenario("fcfs")
    assert victims[0] == "high"  # fcfs: the most recently admitted


def test_priority_policy_runs_everything_to_completion_under_pressure():
    s = make(blocks=8, budget=32, bs=4, policy="priority")
    reqs = [req(6, f"r{i}", max_tokens=10, priority=i % 3, arrival=float(i)) for i in range(6)]
    for r in reqs:
        s.add_request(r)
    run(s)
    assert all(len(r.output_token_ids) == 10 for r in reqs) and s.kv.usage() == 0.0


def test_output_is_deterministic_and_truncation_only():
    long_r, short_r = req(12, "x", max_tokens=20), req(12, "x", max_tokens=5)
    for r in (long_r, short_r):
        s = make()
        s.add_request(r)
        run(s)
    assert long_r.output_token_ids[:5] == short_r.output_token_ids


def test_eos_and_min_tokens():
    key = 12345
    natural = SAMPLER.natural_length(key)
    r = req(4, "e", max_tokens=1000, ignore_eos=False, key=key)
    s = make()
    s.add_request(r)
    run(s)
    assert (
        r.finish_reason == "stop" and r.output_token_ids[-1] == 2 and len(r.output_token_ids) == natural + 1
    )
    r2 = req(4, "m", max_tokens=1000, ignore_eos=False, key=key)
    r2.params.min_tokens = natural + 10
    s = make()
    s.add_request(r2)
    run(s)
    assert len(r2.output_token_ids) == natural + 11


def test_seed_key_greedy_ignores_index():
    p = [1, 2, 3]
    assert seed_key(p, 0.0, 1.0, -1, None, 0) == seed_key(p, 0.0, 1.0, -1, None, 3)
    assert seed_key(p, 0.8, 1.0, -1, None, 0) != seed_key(p, 0.8, 1.0, -1, None, 1)
    assert seed_key(p, 0.8, 1.0, -1, None, 0) != seed_key([1, 2, 4], 0.8, 1.0, -1, None, 0)


def test_remote_kv_request_waits_then_runs():
    s = make()
    r = req(10, "remote")
    r.needs_remote_kv = True
    s.add_request(r)
    assert s.schedule().is_empty and s.new_remote == [r] and r.status is Status.WAITING_FOR_REMOTE_KVS
    r.remote_kv_done = r.remote_kv_ok = True
    r.num_remote_tokens = 10  # the whole prompt (trigger push): only the last token is recomputed
    out = s.schedule()
    assert out.scheduled == [(r, 1)] and r.num_external_tokens == 9 and not r.needs_remote_kv
    run(s)
    assert len(r.output_token_ids) == 4


def test_remote_kv_full_blocks_only_leave_the_tail_to_compute():
    s = make()
    r = req(10, "handoff")
    r.needs_remote_kv = True
    s.add_request(r)
    s.schedule()
    r.remote_kv_done = r.remote_kv_ok = True
    r.num_remote_tokens = 8  # two full blocks of 4 pulled from the prefill engine
    assert s.schedule().scheduled == [(r, 2)] and r.num_external_tokens == 8


def test_remote_kv_failure_falls_back_to_local_prefill():
    s = make()
    r = req(10, "remote")
    r.needs_remote_kv = True
    s.add_request(r)
    s.schedule()
    r.remote_kv_done, r.remote_kv_ok = True, False
    out = s.schedule()
    assert out.scheduled == [(r, 10)]


def test_timing_model_shapes():
    for p in (ASCEND_910B, H100):
        assert p.step_s([], 0, 0) == 0.0
        assert p.expected_ttft_s(2048) > 2 * p.expected_ttft_s(1024) - p.step_overhead_s - p.weights_read_s
        assert p.expected_itl_s(64, 1000) > p.expected_itl_s(1, 1000)
        assert p.step_s([], 1, 10, load_tokens_disk=1000) > p.step_s([], 1, 10, load_tokens_cpu=1000)
        assert p.sources
    assert H100.expected_itl_s(1, 100) < ASCEND_910B.expected_itl_s(1, 100)


def test_cached_tokens_are_counted_when_a_request_is_scheduled_not_when_it_waits_for_blocks():
    """As vLLM's scheduler: `num_cached_tokens` (usage's `cached_tokens`) is the prefix hit when the request is
    scheduled; an attempt that found no free blocks records nothing (the cache may hold more by the time it runs)."""
    s = make(blocks=6, budget=64, bs=4)
    x, b = req(16, "x", max_tokens=4), req(16, "bb", max_tokens=4)  # different prompts, 4 blocks each
    s.add_request(x)
    s.update(s.schedule())
    s.add_request(b)
    out = s.schedule()
    assert (
        b not in [r for r, _ in out.scheduled] and b.num_cached_tokens == -1
    )  # 2 blocks free of the 4 needed
    s.update(out)
    run(s)
    assert b.status is Status.FINISHED_LENGTH and b.num_cached_tokens == 0  # recorded when it did run


def test_the_prefix_cache_counters_count_a_request_once_however_long_it_waits_for_blocks():
    """As vLLM 0.32 (stats recorded at admission): `vllm:prefix_cache_queries` grows by each request's prompt once,
    not once per step it waited for free blocks."""
    s = make(blocks=6, budget=64, bs=4)
    x, b = req(16, "x", max_tokens=8), req(16, "bb", max_tokens=4)
    s.add_request(x)
    s.update(s.schedule())
    s.add_request(b)
    waited = 0
    while b.status is Status.WAITING:
        out = s.schedule()
        waited += b not in [r for r, _ in out.scheduled]
        s.update(out)
    run(s)
    assert waited >= 2  # b was looked up at every step it could not get its blocks
    assert s.kv.queries == 16 + 16 and s.kv.hits == 0
