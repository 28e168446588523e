"""The fleet in virtual time: arrivals are routed by the coordinator's policy objects (with the conductor's
index answering `Match` in-process and the coordinator's workload ledger), and served by simengine instances
stepped by one event queue. No sockets, no sleeps: a step of simulated duration d costs only the Python of
`schedule()` and `update()`.

Time is simulated seconds throughout. Ties in the event queue are broken by insertion order, every policy with
randomness is seeded, so a run is a pure function of (config, arrivals).
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

from bench.fleet.instance import EngineSpec, SimInstance
from bench.fleet.workload import Arrival, PromptSource
from bench.replay import percentile
from conductor.index import KvIndex
from conductor.match import match as conductor_match
from coordinator.kv_match import best_rank_match
from coordinator.latency import LatencyBook, mean_abs_error, ttft_s
from coordinator.picker import candidates
from coordinator.predicted_cache import PredictedCache
from coordinator.scheduling import KvMatch, RequestFacts, create_policy
from coordinator.workload import WorkloadLedger
from simengine.request import Request, SamplingParams
from simengine.sampler import Sampler
from tandem import kv_events
from tandem.chain_hash import chain_hashes

_ARRIVAL, _STEP_END, _LOAD, _DELIVER, _FAULT = 0, 1, 2, 3, 4

#: Measured arrivals between two samples of the caches' replication.
REPLICATION_EVERY = 50

#: How the coordinator learns that a request's prefill is done:
#: - `counter`: Tandem's signal: the engines' `vllm:prompt_tokens_total` (and `generation_tokens_total`), relayed
#:   every `load_interval_s` and applied by the ledger's own `engine_progress` (optionally with its time model);
#: - `first_token`: exactly at the first token (a router in the token path, like Dynamo's);
#: - `end`: only when the response ends (Tandem before issue 11).
SIGNALS = ("counter", "first_token", "end")

#: Where a peer's real system differs from Tandem's defaults, its row uses the real system's behaviour:
#: Dynamo's router is in the token path and marks a request's prefill complete at its first token; llm-d's
#: endpoint picker refreshes every endpoint's metrics every 50 ms by default (`--refresh-metrics-interval`).
#: (SGLang's router inserts each routed prompt into its own tree: `sglang_cache_aware`'s `tree: routed` default.)
PEER_DEFAULTS: dict[str, dict[str, Any]] = {
    "dynamo": {"signal": "first_token"},
    "llm_d": {"load_interval_s": 0.05},
}


@dataclass(frozen=True)
class Faults:
    """Disturbances for the signal's drift test (times in simulated seconds)."""

    abort_share: float = 0.0  # share of requests the client cuts, at a uniform time within `abort_within_s`
    abort_within_s: float = 3.0
    engine_restarts: tuple[
        tuple[float, int], ...
    ] = ()  # (time, instance index): the engine dies and restarts
    coordinator_restarts: tuple[float, ...] = ()  # the coordinator restarts: a new ledger, empty


@dataclass(frozen=True)
class FleetConfig:
    """One simulated fleet."""

    instances: int = 8  # hybrid engines
    policy: str = "kv_affinity"  # scheduling policy type (coordinator.scheduling)
    params: Mapping[str, Any] | None = None  # the policy's parameters
    engine: EngineSpec = EngineSpec()  # every engine's options
    _: KW_ONLY  # the rest by name only
    #: Relative speed of each instance by index (a mixed fleet: 0.5 takes twice as long for every step); instances
    #: beyond the tuple run at 1.0.
    speeds: tuple[float, ...] = ()
    #: How often engine load and progress counters reach the coordinator (the node agent's `load_interval_s`);
    #: None: the policy's real system's (`PEER_DEFAULTS`), else 0.25 s.
    load_interval_s: float | None = None
    route_delay_s: float = 0.0  # from arrival to the engine queue (routing time, in simulated seconds)
    route_jitter_s: float = 0.0  # plus a uniform random delay up to this (seeded by `seed`)
    seed: int = 0  # of the routing jitter
    signal: str | None = (
        None  # one of SIGNALS; None: the policy's real system's (`PEER_DEFAULTS`), else counter
    )
    prefill_rate_tokens_per_s: float = 0.0  # the ledger's time model between reports (0: off)
    predicted_lifetime_s: float = 10.0  # the coordinator's `predicted_cache_lifetime_ms` / 1000
    faults: Faults | None = None
    warmup: int = 0  # first arrivals left out of TTFT and hit-rate figures (they warm the caches)
    #: Sample `FleetResult.replicated` (a pass over every cached block of every engine each `REPLICATION_EVERY`
    #: measured arrivals: a quarter of a 128-instance run's time, so only where a table shows it).
    sample_replication: bool = False
    model: str = "tandem-sim"

    @property
    def effective_signal(self) -> str:
        return self.signal or PEER_DEFAULTS.get(self.policy, {}).get("signal", "counter")

    @property
    def effective_load_interval_s(self) -> float:
        if self.load_interval_s is not None:
            return self.load_interval_s
        return PEER_DEFAULTS.get(self.policy, {}).get("load_interval_s", 0.25)


@dataclass
class FleetResult:
    """What one simulated replay measured (simulated seconds)."""

    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    rejected: int = 0  # longer than the engines' max_model_len (an HTTP 400 from a real engine)
    makespan_s: float = 0.0  # first arrival to last finish
    #: Prompt tokens of measured requests and those found in the engine's prefix cache; without warm-up, the
    #: engines' own counters (`vllm:prefix_cache_queries_total` / `hits_total`, each request once at admission,
    #: preempted ones left out).
    queries: int = 0
    hits: int = 0
    signal_samples: int = (
        0  # (decision, instance) pairs where the ledger's prefill was compared with the truth
    )
    ledger_prefill: float = 0.0  # summed ledger prefill readings
    true_prefill: float = (
        0.0  # summed true queued prefill (committed prefill of requests without a first token)
    )
    abs_error: float = 0.0  # summed |ledger - true|
    error_windows: list = field(default_factory=list)  # (window start s, mean |error|, mean true) per window
    residual_tokens: int = 0  # tokens left on the ledger after the last request ended (drift)
    residual_requests: int = 0
    preemptions: int = 0
    #: (predicted, actual) TTFT of measured requests on the instance chosen: the latency model
    #: (`coordinator.latency`) learned from the progress counters, predicting at routing time.
    ttft_predictions: list = field(default_factory=list)
    #: NPU blocks evicted from the engines' prefix caches while measured requests arrived, and those requests.
    evictions: int = 0
    measured: int = 0
    #: Share of the distinct blocks in the engines' prefix caches that more than one engine holds, averaged over
    #: samples taken every `REPLICATION_EVERY` measured arrivals (how much cache the fleet spends on copies); NaN
    #: unless `FleetConfig.sample_replication`.
    replicated: float = float("nan")
    steps: int = 0
    decisions: int = 0
    match_s: float = 0.0  # wall time in the conductor's Match (chain hashing + index walk)
    candidates_s: float = 0.0  # wall time building candidates (ledger and load lookups)
    pick_s: float = 0.0  # wall time in the policy's pick
    wall_s: float = 0.0  # wall time of the whole simulation

    def pct(self, q: int, values: list[float] | None = None) -> float:
        """q-th percentile (inclusive), NaN when empty."""
        return percentile(self.ttft_s if values is None else values, q)

    @property
    def mean_ttft(self) -> float:
        return statistics.fmean(self.ttft_s) if self.ttft_s else float("nan")

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else float("nan")

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s else float("nan")

    @property
    def signal_ratio(self) -> float:
        """Mean ledger prefill over mean true queued prefill (1 is exact)."""
        return self.ledger_prefill / self.true_prefill if self.true_prefill else float("nan")

    @property
    def signal_error(self) -> float:
        """Mean absolute error of the ledger's prefill, relative to the mean true queued prefill."""
        return self.abs_error / self.true_prefill if self.true_prefill else float("nan")

    @property
    def evictions_per_request(self) -> float:
        return self.evictions / self.measured if self.measured else float("nan")

    @property
    def ttft_prediction_error(self) -> float:
        """Mean |predicted - actual| / actual TTFT over measured requests (NaN without predictions)."""
        return mean_abs_error(self.ttft_predictions) if self.ttft_predictions else float("nan")

    def slo_share(self, slo_s: float) -> float:
        total = len(self.ttft_s) + self.rejected
        return sum(t <= slo_s for t in self.ttft_s) / total if total else float("nan")

    def decision_us(self) -> dict[str, float]:
        """Mean wall microseconds per decision, by phase."""
        n = max(self.decisions, 1)
        return {
            "match": self.match_s / n * 1e6,
            "candidates": self.candidates_s / n * 1e6,
            "pick": self.pick_s / n * 1e6,
        }


class Fleet:
    """Instances, index, ledger and policy of one simulated fleet."""

    def __init__(self, cfg: FleetConfig) -> None:
        if cfg.effective_signal not in SIGNALS:
            raise ValueError(f"signal: one of {SIGNALS}, got {cfg.signal!r}")
        self.cfg = cfg
        self.now = 0.0
        self.policy = create_policy(cfg.policy, cfg.params)
        self.index = KvIndex() if self.policy.needs_match else None
        # Word-like token ids are irrelevant here: only prompts are matched, and outputs never end early.
        self.sampler = Sampler(list(range(1000, 2000)), eos_token_id=2)
        self.instances = [self._instance(i) for i in range(cfg.instances)]
        self.ledger = self._ledger()
        self.predicted = self._predicted()
        self.latency = LatencyBook(budget=cfg.engine.max_num_batched_tokens)
        self.result = FleetResult()

    def _instance(self, i: int) -> SimInstance:
        inst = SimInstance(f"sim-{i}", self.cfg.model, self.cfg.engine, self.sampler, self.index)
        if i < len(self.cfg.speeds):
            inst.speed = self.cfg.speeds[i]
        return inst

    def _clock(self) -> float:
        return self.now

    def _ledger(self) -> WorkloadLedger:
        ledger = WorkloadLedger(self._clock)
        if self.cfg.prefill_rate_tokens_per_s and self.cfg.effective_signal == "counter":
            for inst in self.instances:
                ledger.set_prefill_rate(inst.state.info.instance_id, self.cfg.prefill_rate_tokens_per_s)
        return ledger

    def _predicted(self) -> PredictedCache | None:
        if not getattr(self.policy, "uses_predictions", False):
            return None
        return PredictedCache(self.cfg.predicted_lifetime_s, self._clock)

    def _decide(self, prompt: list[int], facts: RequestFacts) -> tuple[SimInstance, int]:
        r = self.result
        t0 = time.perf_counter()
        matches: dict[str, KvMatch] | None = None
        hashes: tuple[int, ...] = ()
        if self.policy.needs_match:
            hashes = tuple(chain_hashes(prompt, self.cfg.engine.block_size))
            facts = replace(facts, prompt_hashes=hashes)
            matches = {}
            if self.index is not None:
                for hit in conductor_match(
                    self.index, self.cfg.model, block_hashes=hashes, block_size=self.cfg.engine.block_size
                ).instances:
                    matches[hit.instance_id] = best_rank_match(hit)
            if self.predicted is not None:
                ids = [inst.state.info.instance_id for inst in self.instances]
                matches = self.predicted.overlay(hashes, matches, ids, self.cfg.engine.block_size)
        t1 = time.perf_counter()
        pool = candidates([inst.state for inst in self.instances], self.ledger, matches, self.latency)
        t2 = time.perf_counter()
        chosen = self.policy.pick(facts, pool)
        t3 = time.perf_counter()
        if self.predicted is not None:
            self.predicted.routed(chosen.instance_id, hashes)
        r.match_s += t1 - t0
        r.candidates_s += t2 - t1
        r.pick_s += t3 - t2
        r.decisions += 1
        if r.decisions > self.cfg.warmup:
            self._sample_signal(pool)
        matched = min(chosen.match.matched_tokens, facts.isl)
        decoding, context = self.ledger.decoding(chosen.instance_id)
        self._predicted_ttft = ttft_s(
            self.latency.costs(chosen.instance_id),
            chosen.prefill_tokens,
            facts.isl - matched,
            decoding,
            context,
            self.cfg.engine.max_num_batched_tokens,
        )
        return self.instances[int(chosen.instance_id[4:])], matched

    def _sample_signal(self, pool) -> None:
        r, truth = self.result, self._true_prefill
        for c in pool:
            true = truth.get(c.instance_id, 0)
            r.signal_samples += 1
            r.ledger_prefill += c.prefill_tokens
            r.true_prefill += true
            err = abs(c.prefill_tokens - true)
            r.abs_error += err
            self._window_err += err
            self._window_true += true
            self._window_n += 1

    def _evictions(self) -> int:
        return sum(inst.kv.pool.evictions for inst in self.instances)

    def _replication(self) -> float:
        """Share of distinct cached blocks held by more than one instance, now."""
        seen = Counter(itertools.chain.from_iterable(inst.kv.pool.cached for inst in self.instances))
        return (len(seen) - list(seen.values()).count(1)) / len(seen) if seen else 0.0

    def _close_window(self, upto: float) -> None:
        while upto >= self._window_start + self._window_s:
            n = max(self._window_n, 1)
            self.result.error_windows.append(
                (self._window_start, self._window_err / n, self._window_true / n)
            )
            self._window_start += self._window_s
            self._window_err = self._window_true = 0.0
            self._window_n = 0

    def run(
        self,
        arrivals: list[Arrival],
        prompts: PromptSource,
        progress: Callable[[int], None] | None = None,
    ) -> FleetResult:
        """Replays `arrivals` to the end (every request finished)."""
        cfg, r = self.cfg, self.result
        signal = cfg.effective_signal
        load_interval = cfg.effective_load_interval_s
        faults = cfg.faults or Faults()
        wall0 = time.perf_counter()
        queue: list[tuple[float, int, int, Any]] = []
        seq = 0

        def push(at: float, kind: int, obj: Any) -> None:
            nonlocal seq
            heapq.heappush(queue, (at, seq, kind, obj))
            seq += 1

        for a in arrivals:
            queue.append((a.at_s, seq, _ARRIVAL, a))
            seq += 1
        heapq.heapify(queue)
        first_at = arrivals[0].at_s if arrivals else 0.0
        if arrivals:
            push(first_at, _LOAD, None)
        for at, i in faults.engine_restarts:
            push(first_at + at, _FAULT, ("engine", i))
        for at in faults.coordinator_restarts:
            push(first_at + at, _FAULT, ("coordinator", None))
        self._true_prefill: dict[str, int] = {}
        self._window_s, self._window_start = 300.0, first_at
        self._window_err = self._window_true = 0.0
        self._window_n = 0
        pending = len(arrivals)
        live: dict[
            int, list
        ] = {}  # id(request) -> [commitment, arrival, instance, measured, true prefill open]
        max_len = cfg.engine.max_model_len
        rng = random.Random(cfg.seed)
        aborts = random.Random(cfg.seed + 1)
        evictions_at_warmup = 0
        replication: list[float] = []
        last = first_at
        ordinal = 0

        def settle(req: Request, entry: list, started: bool | None) -> None:
            nonlocal pending, last
            commitment, a, inst, measured, open_, ledger = entry[:6]
            iid = inst.state.info.instance_id
            if open_:
                self._true_prefill[iid] -= commitment.prefill_tokens
            if ledger is not None:  # None: the coordinator that committed it restarted since
                ledger.release(commitment, started=started)
            del live[id(req)]
            last = self.now
            pending -= 1
            if progress is not None:
                progress(1)

        while queue:
            now, _, kind, obj = heapq.heappop(queue)
            self.now = now
            self._close_window(now)
            if kind == _STEP_END:
                inst: SimInstance = obj
                if inst.dead:
                    continue
                for req in inst.end_step():
                    entry = live.get(id(req))
                    if entry is None:
                        continue
                    commitment, a, _, measured, open_, ledger = entry[:6]
                    if len(req.output_token_ids) == 1:
                        inst.prompt_counter += len(req.prompt_token_ids)
                        if measured:
                            r.ttft_s.append(now - a.at_s)
                            r.ttft_predictions.append((entry[7], now - a.at_s))
                            r.queries += len(req.prompt_token_ids)
                            r.hits += max(req.num_cached_tokens, 0)
                        if open_:
                            entry[4] = False
                            self._true_prefill[inst.state.info.instance_id] -= commitment.prefill_tokens
                        if signal == "first_token" and ledger is not None:
                            ledger.prefill_done(commitment)
                    inst.generation_counter += 1
                    if req.is_finished:
                        if measured:
                            r.e2e_s.append(now - a.at_s)
                            r.output_tokens += len(req.output_token_ids)
                        settle(req, entry, True)
                dt = inst.start_step()
                if dt is not None:
                    push(now + dt, _STEP_END, inst)
            elif kind == _ARRIVAL:
                a: Arrival = obj
                ordinal += 1
                if a.input_len + a.output_len > max_len:
                    r.rejected += 1
                    pending -= 1
                    if progress is not None:
                        progress(1)
                    continue
                if ordinal > cfg.warmup:
                    if not r.measured:
                        evictions_at_warmup = self._evictions()
                    r.measured += 1
                    if cfg.sample_replication and r.measured % REPLICATION_EVERY == 0:
                        replication.append(self._replication())
                prompt = prompts.tokens(a)
                facts = RequestFacts(f"r{a.key}", cfg.model, a.input_len, a.output_len)
                inst, matched = self._decide(prompt, facts)
                iid = inst.state.info.instance_id
                prefill = a.input_len - matched
                commitment = self.ledger.commit(
                    iid,
                    prefill,
                    a.output_len,
                    a.input_len + a.output_len,
                    a.input_len if signal == "counter" else 0,
                )
                self._true_prefill[iid] = self._true_prefill.get(iid, 0) + prefill
                req = Request(
                    f"r{a.key}-00000000",
                    prompt,
                    SamplingParams(max_tokens=a.output_len, ignore_eos=True, seed_key=a.key),
                    arrival_time=a.at_s,
                )
                live[id(req)] = [
                    commitment, a, inst, ordinal > cfg.warmup, True, self.ledger, req, self._predicted_ttft
                ]  # fmt: skip
                if faults.abort_share and aborts.random() < faults.abort_share:
                    push(now + aborts.uniform(0.0, faults.abort_within_s), _FAULT, ("abort", req))
                delay = cfg.route_delay_s + (
                    rng.uniform(0.0, cfg.route_jitter_s) if cfg.route_jitter_s else 0.0
                )
                if delay > 0:
                    push(now + delay, _DELIVER, (inst, req))
                    continue
                self._enqueue(inst, req, now, push)
            elif kind == _LOAD:
                for inst in self.instances:
                    was_busy = inst.state.load.running > 0
                    inst.report_load(now)
                    if signal == "counter":
                        iid = inst.state.info.instance_id
                        interval = self.ledger.engine_progress(
                            iid, {0: (inst.prompt_counter, inst.generation_counter)}
                        )
                        self.latency.observe(iid, interval, was_busy and inst.state.load.running > 0)
                if pending > 0:
                    push(now + load_interval, _LOAD, None)
            elif kind == _DELIVER:
                inst, req = obj
                if id(req) in live and not inst.dead:
                    self._enqueue(inst, req, now, push)
            else:
                what, arg = obj
                if what == "abort":
                    req = arg
                    entry = live.get(id(req))
                    if entry is not None and not req.is_finished:
                        inst = entry[2]
                        inst.scheduler.abort(req)
                        # The coordinator learns only that the request ended (not whether a token came).
                        settle(req, entry, None)
                elif what == "engine":
                    old = self.instances[arg]
                    old.dead = True
                    for entry in list(live.values()):
                        if entry[2] is old:
                            # Its requests fail: the coordinator learns that they ended.
                            settle(entry[6], entry, None)
                    fresh = self._instance(arg)
                    fresh.state = old.state  # same registration; counters start again from zero
                    if self.index is not None:
                        self.index.apply(old.holder, _CLEARED)
                    self.instances[arg] = fresh
                else:  # coordinator restart: in-flight commitments are lost with the old process
                    for entry in live.values():
                        entry[5] = None
                    self.ledger = self._ledger()
                    self.predicted = self._predicted()
        self._close_window(last + self._window_s)
        if not cfg.warmup:  # every request measured: the engines' own counters, as vLLM's /metrics has them
            r.queries = sum(inst.kv.queries for inst in self.instances)
            r.hits = sum(inst.kv.hits for inst in self.instances)
        r.evictions = self._evictions() - evictions_at_warmup
        if replication:
            r.replicated = statistics.fmean(replication)
        for inst in self.instances:
            r.preemptions += inst.scheduler.num_preemptions
            r.steps += inst.steps
        r.residual_tokens = self.ledger.total_tokens
        r.residual_requests = self.ledger.total_requests
        r.makespan_s = last - first_at
        r.wall_s = time.perf_counter() - wall0
        return r

    @staticmethod
    def _enqueue(inst: SimInstance, req: Request, now: float, push) -> None:
        inst.add(req)
        if not inst.busy:
            dt = inst.start_step()
            if dt is not None:
                push(now + dt, _STEP_END, inst)


_CLEARED = kv_events.AllBlocksCleared()


def simulate(
    cfg: FleetConfig,
    arrivals: list[Arrival],
    token_ids: list[int],
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> FleetResult:
    """One fresh fleet, one replay."""
    return Fleet(cfg).run(arrivals, PromptSource(token_ids, seed), progress)
