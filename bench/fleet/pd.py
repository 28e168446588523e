"""The fleet simulator with prefill/decode disaggregation: prefill instances, decode instances and the KV
transfers between them over a topology's links (`bench.fleet.links`), in virtual time, chosen by a P/D rule
(`bench.fleet.pd_rules`).

Instances are simengine's (`bench.fleet.instance.SimInstance`): the same scheduler (continuous batching, chunked
prefill under `max_num_batched_tokens`), KV cache manager (blocks, prefix cache, LRU eviction) and timing profile
(a step's time grows with its prefill tokens and with the decode batch's size and summed context). A role is only
how requests reach an instance:

- prefill leg: the prompt with `max_tokens` 1; the finished request's blocks stay allocated
  (`hold_blocks_for_remote`) until its KV has left;
- decode leg: the prompt expecting remote KV (`needs_remote_kv`): the engine allocates blocks for the whole prompt
  when its scheduler admits it (a decode instance without free blocks keeps it waiting, exactly as vLLM does),
  then waits for the transfer; the KV moved is the prompt's tokens minus what the decode instance already holds in
  its prefix cache; once it is there the engine computes the last prompt token and decodes;
- local serving (a rule keeps the request on its decode instance, or the fleet is aggregated): a normal request.

Timing, per mode:
- handoff (prefill first): the prefill leg runs; at its first token the decode leg is sent; when the decode engine
  has allocated blocks the transfer starts; at its end the decode engine resumes;
- trigger (decode first): the decode leg is sent at once; when its engine has allocated blocks it calls back
  (`callback_s` later the rule picks the prefill instance, knowing the decode one) and the prefill leg is sent; the
  transfer starts when the prefill engine first schedules the request and streams layer by layer, its last layer
  leaving when the prefill completes (`links`).

The coordinator's ledger is kept as `coordinator.picker` keeps it: a decode leg commits its output and context on the
decode instance until the request ends, a prefill leg commits `ISL - matched` prefill tokens on the prefill
instance until its prefill completes (the coordinator sent that leg itself and knows), a local request commits both
on its instance and its prefill leaves the ledger at its first token.
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bench.fleet.instance import EngineSpec, SimInstance
from bench.fleet.links import Links, Topology
from bench.fleet.pd_rules import PdChoice, PdRule, PdView, create_rule
from bench.fleet.workload import Arrival, PromptSource
from bench.replay import percentile
from conductor.index import KvIndex
from conductor.match import match as conductor_match
from coordinator.capacity import Demand, Engine, Limits, Sizing, size
from coordinator.kv_match import best_rank_match
from coordinator.latency import StepCosts
from coordinator.picker import candidates
from coordinator.predicted_cache import PredictedCache
from coordinator.scheduling import KvMatch, RequestFacts
from coordinator.workload import WorkloadLedger
from simengine.profiles import KV_BYTES_PER_TOKEN_8B, PROFILES
from simengine.request import Request, SamplingParams
from simengine.sampler import Sampler
from tandem.chain_hash import chain_hashes

_ARRIVAL, _STEP_END, _LOAD, _XFER, _KV_IN, _CALLBACK = range(6)

MODES = ("handoff", "trigger")


@dataclass(frozen=True)
class PdConfig:
    """One simulated P/D fleet. Every parameter is documented in docs/benchmarks.md ("P/D in the fleet simulator")."""

    instances: int = 8
    #: Prefill instances (the rest decode); ignored by rules that do not disaggregate (every instance hybrid).
    prefill: int = 4
    rule: str = "tandem_least_load"  # `bench.fleet.pd_rules.RULES`
    mode: str = "handoff"  # one of MODES
    engine: EngineSpec = EngineSpec()  # every engine's options (same for both roles)
    topology: Topology = Topology()
    load_interval_s: float = 0.25  # engine load reports (llm_d: 0.05, its endpoint picker's metrics refresh)
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN_8B  # Llama-3.1-8B in BF16: 128 KiB
    layers: int = 32  # transformer layers: a trigger transfer's last layer waits for the prefill's end
    callback_s: float = 0.002  # trigger: decode engine's callback to the prefill leg's arrival at its engine
    predicted_lifetime_s: float = 10.0  # the coordinator's predicted cache (rules whose policies use it)
    warmup: int = 0  # first arrivals left out of the figures
    ttft_slo_s: float = 2.0  # goodput: TTFT at most this...
    itl_slo_s: float = 0.050  # ...and mean inter-token latency at most this
    model: str = "tandem-sim"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: one of {MODES}, got {self.mode!r}")
        if self.instances < 1:
            raise ValueError(f"instances: at least 1, got {self.instances}")

    @property
    def effective_load_interval_s(self) -> float:
        return 0.05 if self.rule == "llm_d" and self.load_interval_s == 0.25 else self.load_interval_s


@dataclass
class PdResult:
    """What one P/D replay measured (simulated seconds)."""

    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # per request: mean time between its output tokens
    good: int = 0  # measured requests within both SLOs
    measured: int = 0
    rejected: int = 0
    makespan_s: float = 0.0
    queries: int = 0  # prompt tokens of measured requests
    hits: int = 0  # of them, found in the prefix cache of the instance that computed the prompt
    disaggregated: int = 0
    local: int = 0
    bytes_inter_node: float = 0.0
    bytes_intra_node: float = 0.0
    transfer_s: list[float] = field(default_factory=list)  # decode blocks allocated to KV in place
    max_waiting: dict[str, int] = field(default_factory=dict)  # most requests an instance held waiting
    decisions: int = 0
    decide_s: float = 0.0  # wall time in the rule (candidates and decide), excluding Match
    wall_s: float = 0.0
    cpu_s: float = 0.0  # CPU time of the whole simulation (what it costs on an idle core)
    prefill: int = 0  # the split this run used (0: aggregated)
    # Demand over every request, measured or not (P:D sizing, `coordinator.capacity`):
    prompt_computed: int = 0  # prompt tokens computed (prompt minus the computing instance's prefix hit)
    generated: int = 0  # output tokens of finished requests
    context_generated: float = (
        0.0  # output tokens x the context each was generated at (prompt + half the output)
    )
    arrival_span_s: float = 0.0  # first to last arrival
    sizing: Any = None  # `coordinator.capacity.Sizing` from this run's demand (`suggest`)

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(self.ttft_s) if self.ttft_s else float("nan")

    def pct(self, q: int, values: list[float] | None = None) -> float:
        return percentile(self.ttft_s if values is None else values, q)

    @property
    def itl_p99(self) -> float:
        return percentile(self.itl_s, 99)

    @property
    def goodput(self) -> float:
        """Measured requests per simulated second within both SLOs."""
        return self.good / self.makespan_s if self.makespan_s else float("nan")

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else float("nan")


@dataclass(eq=False)
class _Live:
    """One request in flight."""

    arrival: Arrival
    prompt: list[int]
    measured: bool
    choice: PdChoice | None = None
    decode_req: Request | None = None  # the request that produces the answer (decode leg or local)
    prefill_req: Request | None = None
    decode_commit: Any = None
    prefill_commit: Any = None
    transfer: Any = None
    xfer_started: bool = False
    prefill_finished: bool = False
    kv_arrived: bool = (
        False  # trigger: the KV is in place before the prefill leg's response (nothing to move)
    )
    first_at: float | None = None
    hashes: tuple[int, ...] = ()


class PdFleet:
    """Instances, index, ledger, links and rule of one simulated P/D fleet."""

    def __init__(self, cfg: PdConfig, rule: PdRule | None = None) -> None:
        self.cfg = cfg
        self.rule = rule or create_rule(cfg.rule)
        self.now = 0.0
        self.index = KvIndex()
        self.sampler = Sampler(list(range(1000, 2000)), eos_token_id=2)
        self.instances = [
            SimInstance(f"sim-{i}", cfg.model, cfg.engine, self.sampler, self.index)
            for i in range(cfg.instances)
        ]
        self.ids = [inst.state.info.instance_id for inst in self.instances]
        self.by_id = dict(zip(self.ids, self.instances, strict=True))
        self.node = {iid: cfg.topology.node_of(i, cfg.instances) for i, iid in enumerate(self.ids)}
        n_pre = cfg.prefill if self.rule.disaggregates else 0
        if self.rule.disaggregates and not 1 <= n_pre < cfg.instances:
            raise ValueError(f"prefill: between 1 and instances - 1 ({cfg.instances - 1}), got {n_pre}")
        pre_idx = spread(n_pre, cfg.instances, cfg.topology)
        self.prefill_ids = [self.ids[i] for i in pre_idx]
        self.decode_ids = [iid for i, iid in enumerate(self.ids) if i not in set(pre_idx)]
        self.ledger = WorkloadLedger(lambda: self.now)
        self.predicted = PredictedCache(cfg.predicted_lifetime_s, lambda: self.now)
        self.links = Links(cfg.topology)
        self.gen_rate: dict[str, float] = {}
        self._gen_seen: dict[str, int] = {}
        self.result = PdResult(prefill=n_pre)

    # -- decisions --------------------------------------------------------------------------------------------

    def _uses_predictions(self) -> bool:
        policies = [getattr(self.rule, a, None) for a in ("policy", "prefill_policy", "decode_policy")]
        return any(getattr(p, "uses_predictions", False) for p in policies)

    def _matches(self, hashes: tuple[int, ...]) -> dict[str, KvMatch]:
        bs = self.cfg.engine.block_size
        out: dict[str, KvMatch] = {}
        for hit in conductor_match(self.index, self.cfg.model, block_hashes=hashes, block_size=bs).instances:
            out[hit.instance_id] = best_rank_match(hit)
        if self._uses_predictions():
            out = self.predicted.overlay(hashes, out, self.ids, bs)
        return out

    def _view(self, matches: dict[str, KvMatch], decode_fixed: str | None = None) -> PdView:
        states = [inst.state for inst in self.instances]
        by = {s.info.instance_id: s for s in states}
        pre = candidates([by[i] for i in self.prefill_ids], self.ledger, matches)
        dec = candidates([by[i] for i in self.decode_ids], self.ledger, matches)
        free = {
            iid: int((1.0 - by[iid].load.kv_cache_usage) * self.cfg.engine.npu_blocks) for iid in self.ids
        }
        return PdView(
            pre, dec, self.node, free, self.gen_rate, decode_fixed, self.cfg.engine.block_size, self.now
        )

    def _decide(
        self, live: _Live, facts: RequestFacts, decode_fixed: str | None = None
    ) -> tuple[PdChoice, dict]:
        matches = self._matches(live.hashes)
        t0 = time.perf_counter()
        view = self._view(matches, decode_fixed)
        choice = self.rule.decide(facts, view)
        self.result.decide_s += time.perf_counter() - t0
        self.result.decisions += 1
        if choice.decode not in self.decode_ids or (
            choice.prefill is not None and choice.prefill not in self.prefill_ids
        ):
            raise ValueError(f"rule {self.rule.name!r} returned an invalid pair {choice}")
        if decode_fixed is not None and (choice.decode != decode_fixed or choice.prefill is None):
            raise ValueError(f"rule {self.rule.name!r} must keep decode {decode_fixed} and name a prefill")
        return choice, matches

    # -- the event loop ---------------------------------------------------------------------------------------

    def run(
        self, arrivals: list[Arrival], prompts: PromptSource, progress: Callable[[int], None] | None = None
    ):
        cfg, r = self.cfg, self.result
        wall0, cpu0 = time.perf_counter(), time.process_time()
        queue: list[tuple[float, int, int, Any]] = []
        seq = 0

        def push(at: float, kind: int, obj: Any) -> None:
            nonlocal seq
            heapq.heappush(queue, (at, seq, kind, obj))
            seq += 1

        for a in arrivals:
            push(a.at_s, _ARRIVAL, a)
        first_at = arrivals[0].at_s if arrivals else 0.0
        if arrivals:
            push(first_at, _LOAD, None)
        self._push = push
        pending = len(arrivals)
        self._live: dict[int, _Live] = {}  # id(request) -> live (both legs)
        last = first_at
        ordinal = 0
        max_len = cfg.engine.max_model_len
        xfer_version = -1

        def schedule_links() -> None:
            nonlocal xfer_version
            if self.links.version != xfer_version:
                xfer_version = self.links.version
                at = self.links.next_time()
                if at is not None:
                    push(max(at, self.now), _XFER, xfer_version)

        self._schedule_links = schedule_links

        while queue:
            now, _, kind, obj = heapq.heappop(queue)
            self.now = now
            if kind == _STEP_END:
                inst: SimInstance = obj
                for req in inst.end_step():
                    live = self._live.get(id(req))
                    if live is None:
                        continue
                    if req is live.prefill_req:
                        if len(req.output_token_ids) == 1:
                            self._prefill_done(live, inst)
                        continue
                    if len(req.output_token_ids) == 1:
                        live.first_at = now
                        if live.choice.prefill is None:
                            self.ledger.prefill_done(live.decode_commit)
                            self._count_hits(live, req)
                    if req.is_finished:
                        self._finish(live, req, now)
                        del self._live[id(req)]
                        pending -= 1
                        last = now
                        if progress is not None:
                            progress(1)
                inst.busy = False  # its step ended: the next one starts now
                self._kick(inst)
            elif kind == _ARRIVAL:
                a: Arrival = obj
                ordinal += 1
                if a.input_len + a.output_len > max_len:
                    r.rejected += 1
                    pending -= 1
                    continue
                self._arrive(a, prompts.tokens(a), ordinal > cfg.warmup)
            elif kind == _LOAD:
                interval = cfg.effective_load_interval_s
                for inst in self.instances:
                    inst.report_load(now)
                    iid = inst.state.info.instance_id
                    seen = self._gen_seen.get(iid, 0)
                    self.gen_rate[iid] = (inst.generation_counter - seen) / interval
                    self._gen_seen[iid] = inst.generation_counter
                    waiting = len(inst.scheduler.waiting) + len(inst.scheduler.remote_waiting)
                    r.max_waiting[iid] = max(r.max_waiting.get(iid, 0), waiting)
                if pending > 0:
                    push(now + interval, _LOAD, None)
            elif kind == _XFER:
                if obj == xfer_version:
                    self.links.advance(now)
            elif kind == _KV_IN:
                live = obj
                self._kv_in(live)
            elif kind == _CALLBACK:
                self._callback(obj)
            schedule_links()
        r.bytes_inter_node = self.links.bytes_inter_node
        r.bytes_intra_node = self.links.bytes_intra_node
        r.makespan_s = last - first_at
        r.arrival_span_s = arrivals[-1].at_s - first_at if arrivals else 0.0
        r.sizing = suggest(cfg, r)
        r.wall_s = time.perf_counter() - wall0
        r.cpu_s = time.process_time() - cpu0
        return r

    # -- request life -----------------------------------------------------------------------------------------

    def _arrive(self, a: Arrival, prompt: list[int], measured: bool) -> None:
        cfg = self.cfg
        live = _Live(a, prompt, measured)
        live.hashes = tuple(chain_hashes(prompt, cfg.engine.block_size))
        facts = RequestFacts(f"r{a.key}", cfg.model, a.input_len, a.output_len, live.hashes)
        choice, matches = self._decide(live, facts)
        live.choice = choice
        isl, out = a.input_len, a.output_len
        d = self.by_id[choice.decode]
        if measured:
            self.result.measured += 1
        if choice.prefill is None:
            matched = min(matches.get(choice.decode, KvMatch()).matched_tokens, isl)
            live.decode_commit = self.ledger.commit(choice.decode, isl - matched, out, isl + out, 0)
            self.predicted.routed(choice.decode, live.hashes)
            live.decode_req = self._request(live, out)
            self.result.local += measured
            self._send(d, live.decode_req, live)
            return
        self.result.disaggregated += measured
        live.decode_commit = self.ledger.commit(choice.decode, 0, out, isl + out, 0)
        self.predicted.routed(choice.decode, live.hashes)
        if cfg.mode == "handoff":
            self._send_prefill(live, choice.prefill, matches)
        else:  # trigger: the decode leg goes first; the prefill instance is chosen at its callback
            self._send_decode(live)

    def _request(self, live: _Live, max_tokens: int, suffix: str = "") -> Request:
        a = live.arrival
        return Request(
            f"r{a.key}{suffix}-00000000",
            live.prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed_key=a.key),
            arrival_time=a.at_s,
        )

    def _share_hashes(self, src: Request | None, dst: Request) -> None:
        """Both legs hash the same prompt the same way: the second leg reuses the first one's chain hashes (the
        simulator's own shortcut, the engines' result is unchanged)."""
        if src is not None:  # the prompt's full blocks only (the legs' outputs differ)
            full = min(len(src.block_hashes), len(src.prompt_token_ids) // self.cfg.engine.block_size)
            dst.block_hashes = src.block_hashes[:full]
            dst.block_digests = src.block_digests[:full]

    def _send(self, inst: SimInstance, req: Request, live: _Live) -> None:
        self._live[id(req)] = live
        inst.add(req)
        if not inst.busy:
            self._kick(inst)

    def _send_prefill(self, live: _Live, prefill_id: str, matches: dict) -> None:
        isl = live.arrival.input_len
        matched = min(matches.get(prefill_id, KvMatch()).matched_tokens, isl)
        live.prefill_commit = self.ledger.commit(prefill_id, isl - matched, 0, isl, 0)
        self.predicted.routed(prefill_id, live.hashes)
        req = self._request(live, 1, "p")
        req.hold_blocks_for_remote = True
        self._share_hashes(live.decode_req, req)
        live.prefill_req = req
        self._send(self.by_id[prefill_id], req, live)

    def _send_decode(self, live: _Live) -> None:
        req = self._request(live, live.arrival.output_len)
        req.needs_remote_kv = True
        req.num_remote_tokens = live.arrival.input_len
        self._share_hashes(live.prefill_req, req)
        live.decode_req = req
        self._send(self.by_id[live.choice.decode], req, live)

    def _kick(self, inst: SimInstance) -> None:
        """Starts the instance's next step if it is idle, then acts on what the step's scheduling did: decode legs
        that got their blocks start (or call back for) their transfer; trigger prefills that started computing
        start streaming."""
        if not inst.busy:
            dt = inst.start_step()
            if dt is not None:
                self._push(self.now + dt, _STEP_END, inst)
        sched = inst.scheduler
        if sched.new_remote:
            fresh, sched.new_remote = sched.new_remote, []
            for req in fresh:
                live = self._live.get(id(req))
                if live is None:
                    continue
                if self.cfg.mode == "handoff":
                    self._start_transfer(live)
                else:
                    self._push(self.now + self.cfg.callback_s, _CALLBACK, live)
        if self.cfg.mode == "trigger" and inst._out is not None:
            for req, _ in inst._out.scheduled:
                live = self._live.get(id(req))
                if live is not None and req is live.prefill_req and not live.xfer_started:
                    self._start_transfer(live, layered=True)

    def _callback(self, live: _Live) -> None:
        a = live.arrival
        facts = RequestFacts(f"r{a.key}", self.cfg.model, a.input_len, a.output_len, live.hashes)
        choice, matches = self._decide(live, facts, decode_fixed=live.choice.decode)
        live.choice = choice
        self._send_prefill(live, choice.prefill, matches)

    def _start_transfer(self, live: _Live, layered: bool = False) -> None:
        live.xfer_started = True
        held = max(live.decode_req.num_cached_tokens, 0)  # the decode instance's own prefix hit
        tokens = max(live.arrival.input_len - held, 0)
        src, dst = self.node[live.choice.prefill], self.node[live.choice.decode]
        started = self.now

        def done(at: float) -> None:
            if live.measured:
                self.result.transfer_s.append(at - started)
            self._push(at, _KV_IN, live)

        live.transfer = self.links.start(
            self.now, src, dst, tokens * self.cfg.kv_bytes_per_token, self.cfg.layers if layered else 0, done
        )

    def _prefill_done(self, live: _Live, inst: SimInstance) -> None:
        live.prefill_finished = True
        self.ledger.release(live.prefill_commit, started=True)
        self._count_hits(live, live.prefill_req)
        if self.cfg.mode == "handoff":
            self._send_decode(live)
        elif live.kv_arrived:
            self._kv_in(live)
        elif live.transfer is not None:
            if live.transfer.remaining > 0:
                self.links.produced(self.now, live.transfer)

    def _kv_in(self, live: _Live) -> None:
        if (
            not live.prefill_finished
        ):  # trigger, nothing to move: the decode engine resumes with the prefill's end
            live.kv_arrived = True
            return
        req = live.decode_req
        req.remote_kv_done = True
        req.remote_kv_ok = True
        p = self.by_id[live.choice.prefill]
        p.scheduler.release_held(live.prefill_req.request_id)
        self._live.pop(id(live.prefill_req), None)
        self._kick(p)
        self._kick(self.by_id[live.choice.decode])

    def _count_hits(self, live: _Live, req: Request) -> None:
        self.result.prompt_computed += len(req.prompt_token_ids) - max(req.num_cached_tokens, 0)
        if live.measured:
            self.result.queries += len(req.prompt_token_ids)
            self.result.hits += max(req.num_cached_tokens, 0)

    def _finish(self, live: _Live, req: Request, now: float) -> None:
        self.ledger.release(live.decode_commit, started=True)
        out = len(req.output_token_ids)
        self.result.generated += out
        self.result.context_generated += out * (live.arrival.input_len + out / 2)
        if not live.measured:
            return
        r, cfg = self.result, self.cfg
        ttft = live.first_at - live.arrival.at_s
        n = len(req.output_token_ids)
        itl = (now - live.first_at) / (n - 1) if n > 1 else 0.0
        r.ttft_s.append(ttft)
        r.itl_s.append(itl)
        if ttft <= cfg.ttft_slo_s and itl <= cfg.itl_slo_s:
            r.good += 1


def spread(k: int, n: int, topology: Topology | None = None) -> list[int]:
    """The indices of the `k` prefill instances among `n`: taken node by node in turn (the first instance of each
    node, then the second of each...), so that every node holds some of each role where the split allows."""
    topology = topology or Topology()
    order = sorted(range(n), key=lambda i: (i - _first_of_node(i, n, topology), topology.node_of(i, n)))
    return sorted(order[:k])


def _first_of_node(i: int, n: int, topology: Topology) -> int:
    node = topology.node_of(i, n)
    return next(j for j in range(n) if topology.node_of(j, n) == node)


def simulate_pd(
    cfg: PdConfig,
    arrivals: list[Arrival],
    token_ids: list[int],
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> PdResult:
    """One fresh P/D fleet, one replay."""
    return PdFleet(cfg).run(arrivals, PromptSource(token_ids, seed), progress)


def splits(instances: int) -> list[int]:
    """The prefill counts a sweep's first round tries: a quarter, half and three quarters of the fleet."""
    return sorted({max(1, min(instances - 1, round(instances * f))) for f in (0.25, 0.5, 0.75)})


def refine(instances: int, tried: list[int], best_prefill: int) -> list[int]:
    """The second round: the untried neighbours of the first round's best (one instance either side, or half
    the first round's step on large fleets)."""
    step = max(1, round(instances / 8))
    near = {best_prefill - step, best_prefill + step}
    return sorted(p for p in near if 1 <= p < instances and p not in tried)


def profile_costs(engine: EngineSpec, mean_prompt: float) -> StepCosts:
    """The step costs `coordinator.latency` learns from an engine of this profile (what the learner converges
    to: docs/scheduling.md, "Predicted latency"): a prompt token's attention to the half of its prompt before it is
    folded into the prefill cost, as the fit folds it."""
    p = PROFILES[engine.profile]
    return StepCosts(
        step=p.step_overhead_s + p.weights_read_s,
        prefill=p.prefill_s_per_token + p.attn_s_per_pair * mean_prompt / 2,
        decode=p.per_seq_overhead_s,
        context=p.kv_read_s_per_token,
    )


def suggest(cfg: PdConfig, r: PdResult) -> Sizing:
    """The coordinator's P:D sizing (`coordinator.capacity.size`) for this run: demand measured over the
    arrivals (prompt tokens computed, output tokens, mean context), every engine at its profile's costs, its KV
    blocks, and the decode batch bounded by the goodput's ITL."""
    span = r.arrival_span_s or 1.0
    demand = Demand(
        r.prompt_computed / span,
        r.generated / span,
        r.context_generated / r.generated if r.generated else 0.0,
    )
    measured_prompt = r.queries / r.measured if r.measured else 0.0
    costs = profile_costs(cfg.engine, measured_prompt)
    kv = cfg.engine.npu_blocks * cfg.engine.block_size
    if r.prefill:
        engines = [Engine("prefill", costs, kv)] * r.prefill + [Engine("decode", costs, kv)] * (
            cfg.instances - r.prefill
        )
    else:  # aggregated run: size the same fleet as if split (the suggestion does not depend on the current split
        # except for ties)
        engines = [Engine("prefill", costs, kv)] * (cfg.instances // 2) + [Engine("decode", costs, kv)] * (
            cfg.instances - cfg.instances // 2
        )
    limits = Limits(cfg.engine.max_num_batched_tokens, cfg.engine.max_num_seqs, cfg.itl_slo_s)
    return size(cfg.model, demand, engines, limits)


def best(results: list[PdResult]) -> PdResult:
    """The run a rule is judged by: most measured requests within both SLOs, then lowest mean TTFT.

    The count, not the goodput: goodput divides it by the makespan, which on the same arrivals differs by when the
    last request happened to finish, so at a load every split serves within the SLOs it was that tail, not TTFT,
    that picked the split."""
    return max(results, key=lambda r: (r.good, -r.mean_ttft))


def with_split(cfg: PdConfig, prefill: int) -> PdConfig:
    return replace(cfg, prefill=prefill)
