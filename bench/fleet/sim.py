"""The fleet in virtual time: arrivals are routed by the coordinator's policy objects (with the conductor's
index answering `Match` in-process and the coordinator's workload ledger), and served by simengine instances
stepped by one event queue. No sockets, no sleeps: a step of simulated duration d costs only the Python of
`schedule()` and `update()`.

Time is simulated seconds throughout. Ties in the event queue are broken by insertion order, every policy with
randomness is seeded, so a run is a pure function of (config, arrivals).
"""

from __future__ import annotations

import heapq
import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bench.fleet.instance import EngineSpec, SimInstance
from bench.fleet.workload import Arrival, PromptSource
from bench.replay import percentile
from conductor.index import KvIndex
from conductor.match import match as conductor_match
from coordinator.kv_match import best_rank_match
from coordinator.picker import candidates
from coordinator.scheduling import KvMatch, RequestFacts, create_policy
from coordinator.workload import WorkloadLedger
from simengine.request import Request, SamplingParams
from simengine.sampler import Sampler

_ARRIVAL, _STEP_END, _LOAD = 0, 1, 2


@dataclass(frozen=True)
class FleetConfig:
    """One simulated fleet."""

    instances: int = 8  # hybrid engines
    policy: str = "kv_affinity"  # scheduling policy type (coordinator.scheduling)
    params: Mapping[str, Any] | None = None  # the policy's parameters
    engine: EngineSpec = EngineSpec()  # every engine's options
    load_interval_s: float = 4.0  # how often engine load (running, waiting, KV usage) reaches the coordinator
    route_delay_s: float = 0.0  # from arrival to the engine queue (routing time, in simulated seconds)
    route_jitter_s: float = 0.0  # plus a uniform random delay up to this (seeded by `seed`)
    seed: int = 0  # of the routing jitter
    #: What-if: the coordinator learns of each first token and releases the request's prefill tokens then (the
    #: real coordinator releases them only when the response ends).
    release_prefill_at_first_token: bool = False
    model: str = "tandem-sim"


@dataclass
class FleetResult:
    """What one simulated replay measured (simulated seconds)."""

    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    rejected: int = 0  # longer than the engines' max_model_len (an HTTP 400 from a real engine)
    makespan_s: float = 0.0  # first arrival to last finish
    queries: int = 0  # prefix-cache queried tokens, as vllm:prefix_cache_queries_total
    hits: int = 0  # prefix-cache hit tokens, as vllm:prefix_cache_hits_total
    preemptions: int = 0
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
        self.cfg = cfg
        self.policy = create_policy(cfg.policy, cfg.params)
        self.index = KvIndex() if self.policy.needs_match else None
        # Word-like token ids are irrelevant here: only prompts are matched, and outputs never end early.
        sampler = Sampler(list(range(1000, 2000)), eos_token_id=2)
        self.instances = [
            SimInstance(f"sim-{i}", cfg.model, cfg.engine, sampler, self.index) for i in range(cfg.instances)
        ]
        self.ledger = WorkloadLedger()
        self.result = FleetResult()

    def _decide(self, prompt: list[int], facts: RequestFacts) -> tuple[SimInstance, int]:
        r = self.result
        t0 = time.perf_counter()
        matches: dict[str, KvMatch] = {}
        if self.index is not None:
            for hit in conductor_match(self.index, self.cfg.model, token_ids=prompt).instances:
                matches[hit.instance_id] = best_rank_match(hit)
        t1 = time.perf_counter()
        pool = candidates([inst.state for inst in self.instances], self.ledger, matches)
        t2 = time.perf_counter()
        chosen = self.policy.pick(facts, pool)
        t3 = time.perf_counter()
        r.match_s += t1 - t0
        r.candidates_s += t2 - t1
        r.pick_s += t3 - t2
        r.decisions += 1
        return self.instances[int(chosen.instance_id[4:])], min(chosen.match.matched_tokens, facts.isl)

    def run(
        self,
        arrivals: list[Arrival],
        prompts: PromptSource,
        progress: Callable[[int], None] | None = None,
    ) -> FleetResult:
        """Replays `arrivals` to the end (every request finished)."""
        cfg, r, ledger = self.cfg, self.result, self.ledger
        wall0 = time.perf_counter()
        queue: list[tuple[float, int, int, Any]] = []
        seq = 0
        for a in arrivals:
            queue.append((a.at_s, seq, _ARRIVAL, a))
            seq += 1
        heapq.heapify(queue)
        if cfg.load_interval_s > 0 and arrivals:
            heapq.heappush(queue, (arrivals[0].at_s, seq, _LOAD, None))
            seq += 1
        pending = len(arrivals)
        commitments: dict[int, Any] = {}  # id(request) -> (commitment, arrival)
        max_len = cfg.engine.max_model_len
        first_at = arrivals[0].at_s if arrivals else 0.0
        jitter = random.Random(cfg.seed)
        last = first_at
        while queue:
            now, _, kind, obj = heapq.heappop(queue)
            if kind == _STEP_END:
                inst: SimInstance = obj
                for req in inst.end_step():
                    commitment, a = commitments[id(req)]
                    if len(req.output_token_ids) == 1:
                        r.ttft_s.append(now - a.at_s)
                        if cfg.release_prefill_at_first_token and commitment.prefill_tokens:
                            ledger.release(commitment)
                            commitment = ledger.commit(
                                commitment.instance_id, 0, commitment.decode_tokens, commitment.context_tokens
                            )
                            commitments[id(req)] = (commitment, a)
                    if req.is_finished:
                        ledger.release(commitment)
                        del commitments[id(req)]
                        r.e2e_s.append(now - a.at_s)
                        r.output_tokens += len(req.output_token_ids)
                        last = now
                        pending -= 1
                        if progress is not None:
                            progress(1)
                dt = inst.start_step()
                if dt is not None:
                    heapq.heappush(queue, (now + dt, seq, _STEP_END, inst))
                    seq += 1
            elif kind == _ARRIVAL:
                a: Arrival = obj
                if a.input_len + a.output_len > max_len:
                    r.rejected += 1
                    pending -= 1
                    if progress is not None:
                        progress(1)
                    continue
                prompt = prompts.tokens(a)
                facts = RequestFacts(f"r{a.key}", cfg.model, a.input_len, a.output_len)
                inst, matched = self._decide(prompt, facts)
                commitment = ledger.commit(
                    inst.state.info.instance_id,
                    a.input_len - matched,
                    a.output_len,
                    a.input_len + a.output_len,
                )
                req = Request(
                    f"r{a.key}-00000000",
                    prompt,
                    SamplingParams(max_tokens=a.output_len, ignore_eos=True, seed_key=a.key),
                    arrival_time=a.at_s,
                )
                commitments[id(req)] = (commitment, a)
                delay = cfg.route_delay_s + (
                    jitter.uniform(0.0, cfg.route_jitter_s) if cfg.route_jitter_s else 0.0
                )
                if delay > 0:
                    heapq.heappush(queue, (now + delay, seq, _STEP_END + 10, (inst, req)))
                    seq += 1
                    continue
                self._enqueue(inst, req, now, queue, seq)
                seq += 1
            elif kind == _LOAD:
                for inst in self.instances:
                    inst.report_load(now)
                if pending > 0:
                    heapq.heappush(queue, (now + cfg.load_interval_s, seq, _LOAD, None))
                    seq += 1
            else:  # delayed delivery to the engine
                inst, req = obj
                self._enqueue(inst, req, now, queue, seq)
                seq += 1
        for inst in self.instances:
            r.queries += inst.kv.queries
            r.hits += inst.kv.hits
            r.preemptions += inst.scheduler.num_preemptions
            r.steps += inst.steps
        r.makespan_s = last - first_at
        r.wall_s = time.perf_counter() - wall0
        return r

    @staticmethod
    def _enqueue(inst: SimInstance, req: Request, now: float, queue: list, seq: int) -> None:
        inst.add(req)
        if not inst.busy:
            dt = inst.start_step()
            if dt is not None:
                heapq.heappush(queue, (now + dt, seq, _STEP_END, inst))


def simulate(
    cfg: FleetConfig,
    arrivals: list[Arrival],
    token_ids: list[int],
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> FleetResult:
    """One fresh fleet, one replay."""
    return Fleet(cfg).run(arrivals, PromptSource(token_ids, seed), progress)
