"""SLO-aware admission under overload, in virtual time: interactive `priority` traffic and `flex` batch traffic
on simulated engines (simengine's scheduler and 910B timing, scheduling by vLLM's priority as
`coordinator.engine_priority` makes them), at a steady 80% of the fleet's capacity and then a burst, with and
without the coordinator's admission queue.

The queue is the coordinator's own pure core (`coordinator/flow_control.py`: `FlowQueue`, `EngineView`,
`engines_meeting`), fed what the coordinator has: the workload ledger following the engines' progress counters,
the latency model learning their step costs, and their load reports every `load_interval_s`. Heads are checked
on every request's end and every load report, as the shell (`coordinator/flow_gate.py`) does. A refused request
is counted as a 429 and not retried. The admission is a pluggable `Admission`: none ("off"), Tandem's queue
(`TandemAdmission`), or a peer's (`bench.fleet.peer_admission`: llm-d's and Dynamo's, from their sources).

Per tier: SLO attainment (requests whose TTFT, counted from arrival and so including the wait in the queue, and
mean TPOT meet the tier's SLO, over every request sent, refused ones included), TTFT p50/p99 of the served ones,
goodput (output tokens a second of the requests that met their SLO) and refusals (429, or a peer's 503/529).
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from pathlib import Path

from bench.fleet.instance import EngineSpec, SimInstance
from bench.fleet.runs import run_many
from bench.replay import percentile
from coordinator.flow_control import (
    DEFAULT_HEADROOM,
    DEFAULT_SLOS,
    DEFAULT_TPOT_HEADROOM,
    EngineView,
    Entry,
    FlowQueue,
    TierSlo,
    Verdict,
    engines_meeting,
    fits,
)
from coordinator.latency import LatencyBook
from coordinator.picker import candidates
from coordinator.scheduling import RequestFacts, create_policy
from coordinator.tenants import ENGINE_PRIORITY, Tier
from coordinator.workload import WorkloadLedger
from simengine.request import Request, SamplingParams
from simengine.sampler import Sampler

_ARRIVAL, _STEP_END, _LOAD, _TIMER = 0, 1, 2, 3
MODEL = "tandem-sim"


@dataclass(frozen=True)
class TrafficClass:
    tier: Tier
    tenant: str
    share: float  # of requests
    prompt: int  # tokens
    output: int  # tokens


#: Interactive chat (priority) and batch jobs (flex), half of the requests each.
TRAFFIC = (
    TrafficClass(Tier.PRIORITY, "chat", 0.5, 512, 128),
    TrafficClass(Tier.FLEX, "batch", 0.5, 2048, 256),
)


@dataclass(frozen=True)
class OverloadConfig:
    instances: int = 4
    engine: EngineSpec = EngineSpec(npu_blocks=16384)
    steady: float = 0.8  # load, as a share of the fleet's capacity
    burst: float = 1.5
    steady_s: float = 60.0  # steady, then the burst, then steady again
    burst_s: float = 30.0
    admission: bool = True
    slos: dict[Tier, TierSlo] = field(default_factory=lambda: dict(DEFAULT_SLOS))
    headroom: float = DEFAULT_HEADROOM  # `coordinator.flow_control.headroom`
    tpot_headroom: float = DEFAULT_TPOT_HEADROOM  # `coordinator.flow_control.tpot_headroom`
    load_interval_s: float = 0.25
    seed: int = 0
    #: Relative speed of each instance by index (a mixed fleet: 0.5 takes twice as long for every step); instances
    #: past the tuple's end run at 1.
    speeds: tuple[float, ...] = ()


@dataclass
class TierResult:
    sent: int = 0
    refused: int = 0
    refused_after_s: list[float] = field(default_factory=list)  # each refusal's time since its arrival
    met: int = 0
    ttft_s: list[float] = field(default_factory=list)
    arrived_s: list[float] = field(default_factory=list)  # each answered request's arrival, as `ttft_s`
    good_tokens: int = 0


@dataclass
class OverloadResult:
    tiers: dict[Tier, TierResult]
    span_s: float
    queue_peak: int = 0
    residual: int = 0  # ledger requests after the last end (0: nothing leaked)

    def goodput(self, tier: Tier) -> float:
        return self.tiers[tier].good_tokens / self.span_s if self.span_s else float("nan")


def arrivals(rate: float, cfg: OverloadConfig) -> list[tuple[float, TrafficClass]]:
    """Poisson arrivals: `cfg.steady` x `rate` for `steady_s`, `cfg.burst` x `rate` for `burst_s`, steady again."""
    rng = random.Random(cfg.seed)
    out = []
    t = 0.0
    phases = ((cfg.steady, cfg.steady_s), (cfg.burst, cfg.burst_s), (cfg.steady, cfg.steady_s))
    start = 0.0
    for load, duration in phases:
        t = start
        while True:
            t += rng.expovariate(load * rate)
            if t >= start + duration:
                break
            pick = rng.random()
            acc = 0.0
            for c in TRAFFIC:
                acc += c.share
                if pick < acc:
                    out.append((t, c))
                    break
        start += duration
    return out


class Admission:
    """The seam the fleet admits requests through: one policy (Tandem's queue, none, or a peer's rule in
    `bench.fleet.peer_admission`) sees every arrival and the events its real system sees, and answers each request
    with `fleet.dispatch` (now or later) or `fleet.refuse`. The default does nothing: every request goes at once."""

    label = "off"
    holds = False  # whether it can hold requests (a queue peak to report)

    def bind(self, fleet: OverloadFleet) -> None:
        self.fleet = fleet

    def offer(self, arrived: float, c: TrafficClass) -> None:
        """A request arrives (at `fleet.now`)."""
        self.fleet.dispatch(arrived, c)

    def pending(self) -> int:
        """Requests it holds (the run goes on while any)."""
        return 0

    def on_report(self) -> None:
        """The engines' load reports arrived (every `load_interval_s`)."""

    def on_dispatched(self, key: int, instance: int, c: TrafficClass) -> None:
        """Request `key` went to engine `instance`."""

    def on_first_token(self, key: int) -> None:
        """Request `key`'s first token passed (its prefill is done)."""

    def on_end(self, key: int) -> None:
        """Request `key` ended."""

    def on_ends(self) -> None:
        """After one engine step's ends (Tandem's shell checks its queue's head then)."""


def admission_label(headroom: float, tpot_headroom: float) -> str:
    """A Tandem row's label: its headroom of priority's TTFT and TPOT SLOs (1 and 1: none)."""
    if headroom == tpot_headroom == 1.0:
        return "on, headroom 1"
    return f"on, headroom {headroom:g} / TPOT {tpot_headroom:g}"


class TandemAdmission(Admission):
    """The coordinator's own queue (`coordinator/flow_control.py`), fed the ledger, the latency model and the load
    reports, its head checked on every request's end and every load report, as `coordinator/flow_gate.py` does."""

    def __init__(self, slos: dict[Tier, TierSlo], headroom: float, tpot_headroom: float) -> None:
        self.queue = FlowQueue(slos, headroom=headroom, tpot_headroom=tpot_headroom)
        self.holds = True
        self.label = admission_label(headroom, tpot_headroom)
        self._waiting: dict[Entry, tuple[float, TrafficClass]] = {}

    def pending(self) -> int:
        return len(self._waiting)

    def _meeting(self, c: TrafficClass) -> set[int] | None:
        """The instances predicted to meet `c`'s tier's threshold (None: any, one is idle), as
        `FlowGate.meeting`."""
        fleet = self.fleet
        budget = fleet.cfg.engine.max_num_batched_tokens
        met = engines_meeting(fleet.views(), c.prompt, budget, self.queue.threshold(c.tier))
        return None if met is None else set(met)

    def offer(self, arrived: float, c: TrafficClass) -> None:
        fleet, q = self.fleet, self.queue
        entry = Entry(None, c.tier, c.tenant, c.prompt + c.output, fleet.now)
        met = self._meeting(c)
        decision = q.offer(entry, fits(met), fleet.now)
        if decision.displaced is not None:
            displaced_at, displaced = self._waiting.pop(decision.displaced)
            fleet.refuse(displaced, displaced_at)
        if decision.verdict == Verdict.ADMIT:
            fleet.dispatch(arrived, c, met)
        elif decision.verdict == Verdict.REJECT:
            fleet.refuse(c, arrived)
        else:
            self._waiting[entry] = (arrived, c)
            fleet.at(entry.deadline, lambda: self._expire(entry))
            fleet.result.queue_peak = max(fleet.result.queue_peak, len(q))

    def _expire(self, entry: Entry) -> None:
        if not entry.queued:
            return
        arrived, c = self._waiting.pop(entry)
        if self.queue.expire(entry).verdict == Verdict.ADMIT:
            self.fleet.dispatch(arrived, c)
        else:
            self.fleet.refuse(c, arrived)

    def _kick(self) -> None:
        q = self.queue
        while (head := q.head()) is not None:
            arrived, c = self._waiting[head]
            met = self._meeting(c)
            if not fits(met):
                return
            q.release(head, self.fleet.now)
            del self._waiting[head]
            self.fleet.dispatch(arrived, c, met)

    on_report = _kick
    on_ends = _kick


class OverloadFleet:
    def __init__(self, cfg: OverloadConfig, admission: Admission | None = None) -> None:
        self.cfg = cfg
        self.now = 0.0
        sampler = Sampler(list(range(1000, 2000)), eos_token_id=2)
        self.instances = [
            SimInstance(f"sim-{i}", MODEL, cfg.engine, sampler, None) for i in range(cfg.instances)
        ]
        for inst, speed in zip(self.instances, cfg.speeds, strict=False):
            inst.speed = speed
        for inst in self.instances:
            inst.scheduler.priority = True  # --scheduling-policy priority (coordinator.engine_priority)
        self.ledger = WorkloadLedger(lambda: self.now)
        self.latency = LatencyBook(budget=cfg.engine.max_num_batched_tokens)
        self.policy = create_policy("least_load", None)
        if admission is None:
            admission = (
                TandemAdmission(cfg.slos, cfg.headroom, cfg.tpot_headroom) if cfg.admission else Admission()
            )
        self.result = OverloadResult({c.tier: TierResult() for c in TRAFFIC}, 0.0)
        self._heap: list = []
        self._seq = 0
        self._arrivals_left = 0
        # id(request) -> [commitment, class, arrival, first token at, instance, key]
        self._live: dict[int, list] = {}
        self._keys = 0
        self.admission = admission
        admission.bind(self)

    def push(self, at: float, kind: int, obj) -> None:
        heapq.heappush(self._heap, (at, self._seq, kind, obj))
        self._seq += 1

    def at(self, when: float, callback) -> None:
        """Calls `callback()` at simulated time `when` (an admission policy's timer)."""
        self.push(when, _TIMER, callback)

    @property
    def active(self) -> bool:
        """Whether anything is left to happen: arrivals to come, requests in flight or held."""
        return bool(self._arrivals_left or self._live or self.admission.pending())

    # --- the coordinator ------------------------------------------------------------------------------------

    def views(self) -> list[EngineView]:
        views = []
        for inst in self.instances:
            iid = inst.state.info.instance_id
            decoding, context = self.ledger.decoding(iid)
            load = inst.state.load
            views.append(
                EngineView(
                    self.latency.costs(iid),
                    self.ledger.prefill_tokens(iid),
                    decoding,
                    context,
                    self.ledger.requests(iid),
                    load.running,
                    load.waiting,
                    self.latency.prefill_rate(iid),
                )
            )
        return views

    def dispatch(self, arrived: float, c: TrafficClass, allowed: set[int] | None = None) -> None:
        """Sends the request to the engine least_load picks (among the indices in `allowed`, if given)."""
        self._keys += 1
        key = self._keys
        facts = RequestFacts(f"r{key}", MODEL, c.prompt, c.output)
        states = [i.state for n, i in enumerate(self.instances) if allowed is None or n in allowed]
        pool = candidates(states, self.ledger, None, self.latency)
        chosen = self.policy.pick(facts, pool)
        index = int(chosen.instance_id[4:])
        inst = self.instances[index]
        commitment = self.ledger.commit(chosen.instance_id, c.prompt, c.output, c.prompt + c.output, c.prompt)
        rng = random.Random(key)
        prompt = [rng.randrange(1000, 30000) for _ in range(c.prompt)]  # no shared prefixes
        req = Request(
            f"r{key}-0",
            prompt,
            SamplingParams(max_tokens=c.output, ignore_eos=True, seed_key=key),
            arrival_time=arrived,
            priority=ENGINE_PRIORITY[c.tier],
        )
        self._live[id(req)] = [commitment, c, arrived, None, inst, key]
        self.admission.on_dispatched(key, index, c)
        inst.add(req)
        if not inst.busy:
            dt = inst.start_step()
            if dt is not None:
                self.push(self.now + dt, _STEP_END, inst)

    def refuse(self, c: TrafficClass, arrived: float) -> None:
        """The request that arrived at `arrived` is refused now (a 429, 503 or 529 by the policy's system; not
        retried)."""
        t = self.result.tiers[c.tier]
        t.refused += 1
        t.refused_after_s.append(self.now - arrived)

    # --- the run --------------------------------------------------------------------------------------------

    def run(self, arrivals: list[tuple[float, TrafficClass]]) -> OverloadResult:
        for at, c in arrivals:
            self.push(at, _ARRIVAL, c)
        self._arrivals_left = len(arrivals)
        self.push(0.0, _LOAD, None)
        last = 0.0
        while self._heap:
            now, _, kind, obj = heapq.heappop(self._heap)
            self.now = now
            if kind == _ARRIVAL:
                self._arrivals_left -= 1
                self.result.tiers[obj.tier].sent += 1
                self.admission.offer(now, obj)
            elif kind == _STEP_END:
                self._step_end(obj)
                last = now
            elif kind == _LOAD:
                self._report()
                if self.active:
                    self.push(now + self.cfg.load_interval_s, _LOAD, None)
            elif kind == _TIMER:
                obj()
        self.result.span_s = last
        self.result.residual = self.ledger.total_requests
        return self.result

    def _report(self) -> None:
        for inst in self.instances:
            was_busy = inst.state.load.running > 0
            inst.report_load(self.now)
            iid = inst.state.info.instance_id
            interval = self.ledger.engine_progress(iid, {0: (inst.prompt_counter, inst.generation_counter)})
            self.latency.observe(iid, interval, was_busy and inst.state.load.running > 0)
        self.admission.on_report()

    def _step_end(self, inst: SimInstance) -> None:
        ended = False
        for req in inst.end_step():
            entry = self._live.get(id(req))
            if entry is None:
                continue
            commitment, c, arrived, first, _, key = entry
            if len(req.output_token_ids) == 1:
                inst.prompt_counter += len(req.prompt_token_ids)
                entry[3] = first = self.now
                self.admission.on_first_token(key)
            inst.generation_counter += 1
            if req.is_finished:
                self._finish(entry, c, arrived, first)
                self.ledger.release(commitment, started=True)
                del self._live[id(req)]
                self.admission.on_end(key)
                ended = True
        dt = inst.start_step()
        if dt is not None:
            self.push(self.now + dt, _STEP_END, inst)
        if ended:
            self.admission.on_ends()

    def _finish(self, entry, c: TrafficClass, arrived: float, first: float) -> None:
        t = self.result.tiers[c.tier]
        ttft = first - arrived
        tpot = (self.now - first) / max(1, c.output - 1)
        t.ttft_s.append(ttft)
        t.arrived_s.append(arrived)
        slo = self.cfg.slos[c.tier]
        if ttft <= slo.ttft_slo_s and tpot <= slo.tpot_slo_s:
            t.met += 1
            t.good_tokens += c.output


def capacity(cfg: OverloadConfig, backlog: int = 200) -> float:
    """Requests a second the fleet completes of the traffic mix when saturated: a backlog sent at once, without
    admission, divided by its makespan."""
    rng = random.Random(cfg.seed + 7)
    batch = []
    for i in range(backlog):
        pick, acc = rng.random(), 0.0
        for c in TRAFFIC:
            acc += c.share
            if pick < acc:
                batch.append((i * 1e-3, c))
                break
    fleet = OverloadFleet(OverloadConfig(**{**cfg.__dict__, "admission": False}))
    result = fleet.run(batch)
    return backlog / result.span_s


def admissions(cfg: OverloadConfig, peers: bool) -> list:
    """The rows' admission, in order: off, on without headroom (lower tiers may fill all of priority's TTFT SLO),
    as it ships, and (with `peers`) the peers' admission (`bench.fleet.peer_admission`) with their defaults."""
    from bench.fleet.peer_admission import peer_variants

    own = [
        Admission(),
        TandemAdmission(cfg.slos, 1.0, 1.0),
        TandemAdmission(cfg.slos, DEFAULT_HEADROOM, DEFAULT_TPOT_HEADROOM),
    ]
    return own + [make() for make in (peer_variants() if peers else [])]


def run_one(job: tuple[OverloadConfig, int, bool, float]) -> tuple[str, bool, OverloadResult]:
    """One burst under one row's admission (picklable, for process pools): its label, whether it holds
    requests, and the result."""
    cfg, index, peers, rate = job
    admission = admissions(cfg, peers)[index]
    result = OverloadFleet(cfg, admission).run(arrivals(rate, cfg))
    assert result.residual == 0, "the ledger kept requests after the last end"
    return admission.label, admission.holds, result


def mixed_speeds(instances: int) -> tuple[float, ...]:
    """A mixed fleet: the second half of the instances at half speed (a slower accelerator next to a faster one)."""
    return (1.0,) * (instances - instances // 2) + (0.5,) * (instances // 2)


def cmd_overload(args, progress) -> tuple[str, list]:
    base = OverloadConfig(
        instances=args.instances,
        steady=args.steady,
        steady_s=args.steady_s,
        burst_s=args.burst_s,
        seed=args.seed,
        speeds=mixed_speeds(args.instances) if getattr(args, "mixed", False) else (),
    )
    rate = capacity(base)
    progress(1)
    fleet = f"{base.instances} simulated 910B engines"
    if base.speeds:
        fleet += f" ({base.speeds.count(0.5)} of them at half speed)"
    lines = [
        f"Overload: {fleet} (simengine, priority scheduling), "
        f"{TRAFFIC[0].share:.0%} priority chat ({TRAFFIC[0].prompt} in / {TRAFFIC[0].output} out) and "
        f"{TRAFFIC[1].share:.0%} flex batch ({TRAFFIC[1].prompt} in / {TRAFFIC[1].output} out); capacity "
        f"{rate:.1f} requests/s (a saturated backlog's throughput); {base.steady:.0%} of it for {base.steady_s:g} s, "
        f"the burst for {base.burst_s:g} s, {base.steady:.0%} for {base.steady_s:g} s; Poisson, seed {base.seed}. "
        "SLOs: the defaults (priority TTFT 1 s / TPOT 0.1 s, flex 10 s / 0.3 s); TTFT from arrival, in simulated ms.",
        "",
        "| burst | admission | tier | sent | refused | slowest refusal (ms) | SLO met | TTFT p50 | TTFT p99 "
        "| goodput tok/s | queue peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    peers = getattr(args, "peers", True)
    cfgs = [OverloadConfig(**{**base.__dict__, "burst": burst}) for burst in args.bursts]
    jobs = [(cfg, i, peers, rate) for cfg in cfgs for i in range(len(admissions(cfg, peers)))]
    results = run_many(jobs, getattr(args, "workers", 0), progress, run=run_one)
    for (cfg, *_), (label, holds, result) in zip(jobs, results, strict=True):
        for c in TRAFFIC:
            t = result.tiers[c.tier]
            slowest = f"{max(t.refused_after_s) * 1000:.0f}" if t.refused_after_s else "-"
            lines.append(
                f"| {cfg.burst:g}x | {label} | {c.tier.value} | {t.sent} | {t.refused} | {slowest} "
                f"| {t.met / t.sent:.0%} | {percentile(t.ttft_s, 50) * 1000:.0f} "
                f"| {percentile(t.ttft_s, 99) * 1000:.0f} | {result.goodput(c.tier):.0f} | "
                f"{result.queue_peak if holds else '-'} |"
            )
            rows.append((cfg.burst, label, c.tier.value, t, result))
    lines += ["", *goal_lines(rows)]
    if getattr(args, "plot", None):
        plot(rows, base, Path(args.plot))
    return "\n".join(lines), rows


#: The row of Tandem's admission as it ships.
SHIPPED = admission_label(DEFAULT_HEADROOM, DEFAULT_TPOT_HEADROOM)
#: Tandem's own rows (the rest are the peers').
OWN_LABELS = ("off", "on, headroom 1", SHIPPED)


def goal_lines(rows) -> list[str]:
    """Issue 22's goal per burst, for the row as it ships: priority's SLO attainment, total goodput against every
    peer row's, and the slowest refusal."""
    out = []
    for burst in sorted({r[0] for r in rows}):
        here = [r for r in rows if r[0] == burst]
        total: dict[str, float] = {}
        for _, label, _, _, result in here:
            total[label] = sum(result.goodput(tier) for tier in result.tiers)
        ours = [t for _, label, tier, t, _ in here if label == SHIPPED and tier == Tier.PRIORITY.value]
        peers = {label: g for label, g in total.items() if label not in OWN_LABELS}
        if not ours or not peers:
            continue
        best_label = max(peers, key=peers.__getitem__)
        slowest = max(
            (w for _, label, _, t, _ in here if label == SHIPPED for w in t.refused_after_s), default=0.0
        )
        ratio = total[SHIPPED] / peers[best_label]
        met = ours[0].met / ours[0].sent
        ok = met >= 0.99 and ratio >= 1.3 and slowest <= 0.05
        out.append(
            f"Goal at {burst:g}x ({'met' if ok else 'missed'}): priority SLO met {met:.1%} (>= 99%); goodput over "
            f"both tiers {total[SHIPPED]:.0f} tok/s, x{ratio:.2f} the best peer row ({best_label}, "
            f"{peers[best_label]:.0f}; >= x1.3); slowest refusal {slowest * 1000:.0f} ms (<= 50 ms)."
        )
    return out


#: The rows the plot draws, by admission label (`Admission.label`): none, as it ships, and the peers' queueing.
PLOTTED = ("off", SHIPPED, "llm-d flow control", "Dynamo (as shipped)")


def plot(rows, cfg: OverloadConfig, path: Path) -> None:
    """TTFT of every answered request against its arrival time during the largest burst, per tier: admission off,
    as it ships, and the peers' queueing rows (when run); the burst shaded, each tier's TTFT SLO dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    burst = max(b for b, *_ in rows)
    tiers = [c.tier for c in TRAFFIC]
    fig, axes = plt.subplots(1, len(tiers), figsize=(13, 4.2), sharex=True)
    for ax, tier in zip(axes, tiers, strict=True):
        for b, label, name, t, _ in rows:
            if b == burst and name == tier.value and label in PLOTTED:
                ax.scatter(t.arrived_s, [x * 1000 for x in t.ttft_s], s=3, alpha=0.6, label=label)
        ax.axvspan(
            cfg.steady_s, cfg.steady_s + cfg.burst_s, color="grey", alpha=0.15, label=f"{burst:g}x burst"
        )
        ax.axhline(cfg.slos[tier].ttft_slo_s * 1000, color="black", linestyle="--", linewidth=0.8,
                   label="TTFT SLO")  # fmt: skip
        ax.set_yscale("log")
        ax.set_xlabel("arrival (simulated s)")
        ax.set_title(f"{tier.value}: TTFT (simulated ms)")
    axes[0].legend(fontsize=7, markerscale=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
