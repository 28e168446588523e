"""The overload simulation (`python -m bench.fleet overload`) on a short run: the coordinator's admission core in
virtual time serves priority traffic sooner under a 3x burst, refuses only what it cannot hold, and leaks nothing;
the peers' admission rules (llm-d, Dynamo) decide as their sources say, on the signals they really read."""

from __future__ import annotations

from bench.fleet.overload import (
    TRAFFIC,
    OverloadConfig,
    OverloadFleet,
    TrafficClass,
    arrivals,
    capacity,
    cmd_overload,
)
from bench.fleet.peer_admission import (
    DYNAMO_DOC_DECODE_BLOCKS,
    DYNAMO_DOC_PREFILL_TOKENS,
    DYNAMO_QUEUE_THRESHOLD,
    LLMD_SCRAPE_S,
    LLMD_STALENESS_S,
    Dynamo,
    LlmDFlowControl,
    LlmDShipped,
    llmd_saturation,
    peer_variants,
)
from coordinator.tenants import Tier


def test_a_burst_is_held_and_priority_goes_first():
    base = OverloadConfig(steady_s=10.0, burst_s=5.0, burst=3.0)
    rate = capacity(base)
    assert 5 < rate < 50
    off = OverloadFleet(OverloadConfig(**{**base.__dict__, "admission": False})).run(arrivals(rate, base))
    on = OverloadFleet(base).run(arrivals(rate, base))
    assert off.residual == 0 and on.residual == 0
    for tier in (Tier.PRIORITY, Tier.FLEX):
        assert on.tiers[tier].sent == off.tiers[tier].sent
        served = on.tiers[tier].sent - on.tiers[tier].refused
        assert len(on.tiers[tier].ttft_s) == served  # everything admitted completed
    assert on.tiers[Tier.PRIORITY].refused == 0 and on.queue_peak > 0
    p50 = sorted(on.tiers[Tier.PRIORITY].ttft_s)[len(on.tiers[Tier.PRIORITY].ttft_s) // 2]
    p50_off = sorted(off.tiers[Tier.PRIORITY].ttft_s)[len(off.tiers[Tier.PRIORITY].ttft_s) // 2]
    assert p50 < p50_off
    assert on.tiers[Tier.PRIORITY].met > off.tiers[Tier.PRIORITY].met
    # Headroom (as it ships) against none: lower tiers stop before priority's SLO is full.
    full = OverloadFleet(OverloadConfig(**{**base.__dict__, "headroom": 1.0, "tpot_headroom": 1.0})).run(
        arrivals(rate, base)
    )
    assert on.tiers[Tier.PRIORITY].met > full.tiers[Tier.PRIORITY].met


def test_the_command_writes_one_row_per_burst_admission_and_tier():
    class Args:
        instances, steady, steady_s, burst_s, seed, bursts, peers = 2, 0.8, 3.0, 2.0, 0, [3.0], True

    text, rows = cmd_overload(Args, lambda n: None)
    assert len(rows) == 2 * (3 + len(peer_variants()))
    assert "| 3x | on, headroom 0.5 / TPOT 0.8 | flex |" in text and "| 3x | on, headroom 1 |" in text
    assert "| 3x | llm-d flow control | priority |" in text and "| 3x | Dynamo (as shipped) | flex |" in text


def test_the_plot_draws_each_answered_request_at_its_arrival(tmp_path):
    class Args:
        instances, steady, steady_s, burst_s, seed, bursts, peers = 2, 0.8, 3.0, 2.0, 0, [3.0], False
        plot = str(tmp_path / "overload.png")

    _, rows = cmd_overload(Args, lambda n: None)
    for *_, t, _ in rows:
        assert len(t.arrived_s) == len(t.ttft_s) == t.sent - t.refused
        assert t.arrived_s and max(t.arrived_s) <= 3.0 + 2.0 + 3.0  # arrivals, not answer times
    assert (tmp_path / "overload.png").stat().st_size > 10_000


# --- the peers' admission (bench/fleet/peer_admission.py) -----------------------------------------------------


class _Engine:
    """What the peers read of an engine: its scheduler's queues and its KV usage."""

    def __init__(self) -> None:
        self.scheduler = type("S", (), {"waiting": [], "remote_waiting": []})()
        self.usage = 0.0
        self.kv = type("K", (), {"usage": lambda _: self.usage})()


class _Fleet:
    """A fleet without engines: records what the admission decides; timers run when `advance` says."""

    def __init__(self, engines: int = 2) -> None:
        self.cfg = OverloadConfig(instances=engines)
        self.instances = [_Engine() for _ in range(engines)]
        self.now = 0.0
        self.timers: list = []
        self.sent: list = []  # (class, allowed)
        self.refused: list = []
        self.result = type("R", (), {"queue_peak": 0})()
        self.active = True

    def at(self, when, callback) -> None:
        self.timers.append((when, callback))

    def advance(self, to: float) -> None:
        while due := sorted((t for t in self.timers if t[0] <= to), key=lambda t: t[0]):
            when, callback = due[0]
            self.timers.remove(due[0])
            self.now = when
            callback()
        self.now = to

    def dispatch(self, arrived, c, allowed=None) -> None:
        self.sent.append((c, allowed))

    def refuse(self, c, arrived) -> None:
        self.refused.append(c)


PRIO, FLEX = TRAFFIC


def test_llm_d_saturation_is_the_mean_roofline_and_stale_metrics_count_full():
    assert llmd_saturation([], 0.0) == 1.0
    # max(waiting / 5, kv / 0.8) per endpoint, then the mean.
    assert llmd_saturation([(5, 0.0, 0.0), (0, 0.4, 0.0)], 0.1) == (1.0 + 0.5) / 2
    assert llmd_saturation([(0, 0.0, 0.0)], LLMD_STALENESS_S + 0.01) == 1.0


def test_llm_d_as_shipped_sheds_only_sheddable_requests_when_saturated():
    fleet = _Fleet()
    adm = LlmDShipped()
    adm.bind(fleet)
    fleet.advance(0.0)  # first scrape: idle
    adm.offer(0.0, FLEX)
    for e in fleet.instances:
        e.scheduler.waiting = [object()] * 5  # waiting at the threshold: saturation 1.0
    fleet.advance(LLMD_SCRAPE_S)
    adm.offer(0.05, FLEX)
    adm.offer(0.05, PRIO)
    assert [c for c, _ in fleet.sent] == [FLEX, PRIO] and fleet.refused == [FLEX]


def test_llm_d_flow_control_holds_every_band_while_saturated_then_sends_priority_first_fcfs():
    fleet = _Fleet()
    adm = LlmDFlowControl()
    adm.bind(fleet)
    for e in fleet.instances:
        e.usage = 0.8  # KV at the threshold: saturated
    fleet.advance(0.0)
    flex_a, flex_b = (TrafficClass(FLEX.tier, t, 0.5, 2048, 256) for t in ("a", "b"))
    for c in (flex_a, PRIO, flex_b):
        adm.offer(fleet.now, c)
    fleet.advance(0.04)  # ticks in between scrapes send nothing
    assert fleet.sent == [] and adm.pending() == 3 and fleet.result.queue_peak == 3
    for e in fleet.instances:
        e.usage = 0.0
    fleet.advance(0.2)  # next scrape: one request a 1 ms tick, the higher band first, FCFS within a band
    assert [c for c, _ in fleet.sent] == [PRIO, flex_a, flex_b] and adm.pending() == 0 and not fleet.refused


def test_dynamo_queues_while_every_worker_is_prefill_busy_and_rejects_529_past_busy_thresholds():
    fleet = _Fleet()
    adm = Dynamo()  # as shipped: router queue at 4.0 x max_num_batched_tokens, no busy thresholds
    adm.bind(fleet)
    limit = DYNAMO_QUEUE_THRESHOLD * fleet.cfg.engine.max_num_batched_tokens
    big = TrafficClass(FLEX.tier, "batch", 0.5, int(limit) + 1, 1)
    for key, worker in ((1, 0), (2, 1)):
        adm.on_dispatched(key, worker, big)  # both workers past the queue threshold
    adm.offer(0.0, FLEX)
    adm.offer(0.0, PRIO)
    assert fleet.sent == [] and adm.pending() == 2
    adm.on_first_token(1)  # worker 0's prefill done: the queue drains, strict priority first
    assert [c for c, _ in fleet.sent] == [PRIO, FLEX] and not fleet.refused

    fleet = _Fleet()
    adm = Dynamo(DYNAMO_DOC_PREFILL_TOKENS, DYNAMO_DOC_DECODE_BLOCKS, queue_threshold=None)
    adm.bind(fleet)
    over = TrafficClass(FLEX.tier, "batch", 0.5, DYNAMO_DOC_PREFILL_TOKENS + 1, 1)
    adm.on_dispatched(1, 0, over)
    adm.offer(0.0, PRIO)  # worker 0 overloaded: routed among the others only
    assert fleet.sent == [(PRIO, {1})]
    adm.on_dispatched(2, 1, over)
    adm.offer(0.0, PRIO)  # every worker overloaded: refused (529), whatever the tier
    assert fleet.refused == [PRIO]
    adm.on_end(2)
    adm.offer(0.0, FLEX)
    assert fleet.sent[-1] == (FLEX, {1})


def test_the_peers_rows_run_the_same_burst_and_leak_nothing():
    base = OverloadConfig(instances=2, steady_s=4.0, burst_s=3.0, burst=3.0)
    rate = capacity(base)
    load = arrivals(rate, base)
    for make in peer_variants():
        adm = make()
        result = OverloadFleet(base, adm).run(load)
        assert result.residual == 0 and adm.pending() == 0, adm.label
        for c in TRAFFIC:
            t = result.tiers[c.tier]
            assert t.sent == sum(1 for _, a in load if a is c), adm.label
            assert len(t.ttft_s) == t.sent - t.refused, adm.label  # every admitted request completed
        if adm.label.startswith("llm-d"):
            assert result.tiers[Tier.PRIORITY].refused == 0, adm.label  # llm-d never sheds priority >= 0
