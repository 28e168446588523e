"""LoRA adapters in the fleet simulator (`python -m bench.fleet lora`): per-request adapters with a Zipf popularity
(stationary or shifting over time), per-instance adapter slots (`max_loras`, LRU among idle adapters), a cold-load
time that stalls the engine, and per-adapter KV; four rows: adapter-blind `kv_affinity`, llm-d's
`lora-affinity-scorer` in its default profile, Dynamo's LoRA-aware KV routing, Tandem's `lora_affinity`.

Engine model (vLLM's, simplified): an instance holds at most `max_loras` adapters. A request whose adapter is
resident runs at once; otherwise the adapter is loaded into a free slot, or in place of the least recently used
adapter without requests in flight, and the engine's next step takes `load_s` longer (vLLM loads adapters in
the worker's step, every running request waits); when every slot holds an adapter with requests in flight, the
request waits at the engine until one drains (vLLM's scheduler skips requests whose adapter would exceed
`max_loras`). KV blocks are per adapter as vLLM's hashes make them (the adapter is an extra key of every block,
`tandem.chain_hash.adapter_root`): here every prompt starts with its adapter's own system prompt, so two adapters
never share a block, and the conductor's index and every router's match see exactly that.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import xxhash

from bench.fleet.instance import EngineSpec, SimInstance
from bench.fleet.routing import prefill_rate
from bench.fleet.sim import Fleet, FleetConfig, FleetResult
from bench.fleet.workload import Arrival, PromptSource
from coordinator.scheduling import Candidate, RequestFacts
from coordinator.scheduling.dynamo import Dynamo
from simengine.request import Request


@dataclass(frozen=True)
class LoraSpec:
    """Adapters on every engine."""

    max_loras: int = 4  # adapter slots per engine (vLLM `--max-loras`)
    load_s: float = 0.25  # seconds one adapter load adds to the engine's step


@dataclass(frozen=True)
class LoraWorkload:
    """Requests over `adapters` adapters with a Zipf(`zipf_s`) popularity."""

    adapters: int = 50
    instances: int = 8
    shifting: bool = False  # popularity re-ranked at random `phases` times over the run
    requests: int = 1500
    warmup: int = 150  # first requests left out of the figures
    load: float = 0.6  # arrival rate: this share of the fleet's prefill capacity, counting every prompt token
    zipf_s: float = 1.0
    phases: int = 3
    prefix_tokens: int = 1024  # the adapter's system prompt (shared by its requests)
    suffix_tokens: tuple[int, int] = (128, 512)  # the request's own tokens, uniform in this range
    output_tokens: int = 64
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.adapters} adapters, {self.instances} instances, {'shifting' if self.shifting else 'stationary'}"


def adapter_name(i: int) -> str:
    return f"lora-{i:03d}"


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (r + 1) ** s for r in range(n)]
    total = sum(w)
    return [x / total for x in w]


@dataclass
class LoraArrivals:
    """Arrivals, each request's adapter and prompt tokens."""

    arrivals: list[Arrival]
    adapter: dict[int, str]  # arrival key -> adapter name
    prompts: dict[int, list[int]]  # arrival key -> prompt tokens


def make_arrivals(w: LoraWorkload, engine: EngineSpec, word_ids: Sequence[int]) -> LoraArrivals:
    """Poisson arrivals at `w.load` of the fleet's prefill capacity; adapters drawn by rank from Zipf weights, the
    rank -> adapter mapping redrawn at each phase when `w.shifting`."""
    rng = random.Random(w.seed)
    weights = zipf_weights(w.adapters, w.zipf_s)
    ranks = list(range(w.adapters))
    mean_prompt = w.prefix_tokens + sum(w.suffix_tokens) / 2
    rate = w.load * w.instances * prefill_rate(engine) / mean_prompt  # requests per second
    system = {
        a: [word_ids[(a * 7919 + i * 104729) % len(word_ids)] for i in range(w.prefix_tokens)]
        for a in range(w.adapters)
    }
    perm = list(range(w.adapters))
    per_phase = math.ceil(w.requests / w.phases)
    out, adapter, prompts = [], {}, {}
    at = 0.0
    for k in range(w.requests):
        if w.shifting and k % per_phase == 0 and k:
            rng.shuffle(perm)
        at += rng.expovariate(rate)
        a = perm[rng.choices(ranks, weights)[0]]
        suffix = rng.randint(*w.suffix_tokens)
        tokens = system[a] + [rng.choice(word_ids) for _ in range(suffix)]
        out.append(Arrival(at, (), len(tokens), w.output_tokens, k))
        adapter[k] = adapter_name(a)
        prompts[k] = tokens
    return LoraArrivals(out, adapter, prompts)


class _Prompts(PromptSource):
    def __init__(self, prompts: Mapping[int, list[int]]) -> None:  # noqa: D107 - no PromptTokens state needed
        self._prompts = prompts

    def tokens(self, a: Arrival) -> list[int]:
        return self._prompts[a.key]


class LoraInstance(SimInstance):
    """A simulated engine with `max_loras` adapter slots (see the module docstring)."""

    def __init__(self, *args, lora: LoraSpec, on_load, **kw) -> None:
        super().__init__(*args, **kw)
        self.lora = lora
        self.on_load = on_load  # called with the request whose adapter is loaded
        self.slots: OrderedDict[str, int] = OrderedDict()  # adapter -> requests admitted (LRU first)
        self.parked: deque[Request] = deque()  # waiting for a slot
        self.adapter_of: dict[int, str] = {}  # id(request) -> adapter
        self.stall_s = 0.0  # load time the next step carries

    def add(self, request: Request) -> None:
        if not self._admit(request):
            self.parked.append(request)

    def _admit(self, request: Request) -> bool:
        adapter = self.adapter_of.get(id(request), "")
        if adapter:
            if adapter in self.slots:
                self.slots[adapter] += 1
                self.slots.move_to_end(adapter)
            else:
                if len(self.slots) >= self.lora.max_loras:
                    victim = next((a for a, n in self.slots.items() if n == 0), None)
                    if victim is None:
                        return False
                    del self.slots[victim]
                self.slots[adapter] = 1
                self.stall_s += self.lora.load_s
                self.on_load(request)
        self.scheduler.add_request(request)
        return True

    def start_step(self) -> float | None:
        dt = super().start_step()
        if dt is not None and self.stall_s:
            dt += self.stall_s
            self.stall_s = 0.0
        return dt

    def end_step(self) -> list[Request]:
        produced = super().end_step()
        released = False
        for req in produced:
            if req.is_finished:
                adapter = self.adapter_of.pop(id(req), "")
                if adapter:
                    self.slots[adapter] -= 1
                    released = True
        if released and self.parked:
            waiting, self.parked = self.parked, deque()
            for req in waiting:
                if not self._admit(req):
                    self.parked.append(req)
        return produced

    def report_load(self, now: float) -> None:
        super().report_load(now)
        load = self.state.load
        load.waiting += len(self.parked)
        load.adapters = frozenset(self.slots)
        load.active_adapters = frozenset(a for a, n in self.slots.items() if n) | frozenset(
            self.adapter_of[id(r)] for r in self.parked
        )
        load.max_loras = self.lora.max_loras


class LoraFleet(Fleet):
    """The fleet with adapters: arrivals carry an adapter, instances have slots."""

    def __init__(
        self, cfg: FleetConfig, lora: LoraSpec, adapters: Mapping[int, str], measured_from: int
    ) -> None:
        self.lora = lora
        self.adapter_by_key = adapters
        self.measured_from = measured_from
        self.cold_loads = 0  # loads caused by measured requests
        super().__init__(cfg)

    def _instance(self, i: int) -> SimInstance:
        inst = LoraInstance(
            f"sim-{i}",
            self.cfg.model,
            self.cfg.engine,
            self.sampler,
            self.index,
            lora=self.lora,
            on_load=self._loaded,
        )
        if i < len(self.cfg.speeds):
            inst.speed = self.cfg.speeds[i]
        return inst

    def _loaded(self, request: Request) -> None:
        if _key(request.request_id) >= self.measured_from:
            self.cold_loads += 1

    def _decide(self, prompt: list[int], facts: RequestFacts):
        return super()._decide(prompt, replace(facts, adapter=self.adapter_by_key[_key(facts.request_id)]))

    def _enqueue(self, inst: LoraInstance, req: Request, now: float, push) -> None:  # type: ignore[override]
        inst.adapter_of[id(req)] = self.adapter_by_key[_key(req.request_id)]
        Fleet._enqueue(inst, req, now, push)


def _key(request_id: str) -> int:
    """Arrival key of a simulated request id (`r<key>` or `r<key>-<suffix>`)."""
    return int(request_id[1:].split("-", 1)[0])


# --- Dynamo's LoRA-aware routing ----------------------------------------------------------------------------------


def _hrw(adapter: str, instance_id: str) -> int:
    """Rendezvous score of (adapter, worker): Dynamo ranks workers by it (blake3 there; any stable hash will do)."""
    return xxhash.xxh3_64_intdigest(f"{adapter}\0{instance_id}".encode())


@dataclass
class _Entry:
    replicas: list[str]
    active: bool
    last_scale_down: int = 0


@dataclass
class DynamoLora:
    """Dynamo's LoRA routing ahead of its KV router (ai-dynamo/dynamo `lib/llm/src/lora/`, 2026): a controller
    (`controller.rs`, defaults in `config.rs`: HRW allocation every `timestep_s` = 3 s, scale-down cooldown of 3
    ticks, per-adapter load estimated from arrivals over a 90 s window smoothed by an EMA with alpha 0.3) gives each
    active adapter `ceil(load share * total slots)` replicas (at least 1, at most the workers, scaled down to the
    slot budget), placed by sticky slot-aware rendezvous hashing (`routing/hrw.rs`), and pins an inactive adapter
    to its top-ranked worker; the filter (`filter.rs`) keeps the replicas that have the adapter loaded, else the
    whole replica set (a lazy load), else, for an adapter the controller has not placed, the workers that have it
    loaded, else all. Dynamo's KV cost (`coordinator.scheduling.dynamo`) picks among them; its block hashes carry
    the adapter (`lora_name` in `compute_block_hash_for_seq`), as the conductor's do here."""

    kv: Dynamo = field(default_factory=Dynamo)
    timestep_s: float = 3.0
    window_s: float = 90.0
    ema_alpha: float = 0.3
    cooldown_ticks: int = 3
    name: str = "dynamo_lora"
    needs_match: bool = True
    uses_predictions: bool = False
    _arrivals: deque = field(default_factory=deque)  # (time, adapter)
    _load: dict[str, float] = field(default_factory=dict)
    _table: dict[str, _Entry] = field(default_factory=dict)
    _next_tick: float = 0.0
    _tick: int = 0

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        now = max(c.state.load.sampled_at for c in candidates)
        while now >= self._next_tick:
            self._recompute(self._next_tick, candidates)
            self._next_tick += self.timestep_s
        a = request.adapter
        if a:
            self._arrivals.append((now, a))
            allowed = set(self._filter(a, candidates))
            candidates = [c for c in candidates if c.instance_id in allowed] or list(candidates)
        return self.kv.pick(request, candidates)

    def _filter(self, a: str, candidates: Sequence[Candidate]) -> list[str]:
        ids = [c.instance_id for c in candidates]
        loaded = {c.instance_id for c in candidates if a in c.state.load.adapters}
        entry = self._table.get(a)
        if entry is None:
            return [i for i in ids if i in loaded] or ids
        replicas = [i for i in entry.replicas if i in ids]
        if entry.active:
            return [i for i in replicas if i in loaded] or replicas or self._fallback(a, ids, loaded)
        return replicas[:1] or self._fallback(a, ids, loaded)

    @staticmethod
    def _fallback(a: str, ids: list[str], loaded: set[str]) -> list[str]:
        return [i for i in ids if i in loaded] or [max(ids, key=lambda i: (_hrw(a, i), i))]

    def _recompute(self, now: float, candidates: Sequence[Candidate]) -> None:
        self._tick += 1
        while self._arrivals and self._arrivals[0][0] < now - self.window_s:
            self._arrivals.popleft()
        counts: dict[str, int] = {}
        for _, a in self._arrivals:
            counts[a] = counts.get(a, 0) + 1
        for a in set(self._load) | set(counts):
            self._load[a] = (1 - self.ema_alpha) * self._load.get(a, 0.0) + self.ema_alpha * counts.get(a, 0)
        workers = sorted(c.instance_id for c in candidates)
        cap = {c.instance_id: c.state.load.max_loras for c in candidates}
        used = {c.instance_id: len(c.state.load.adapters) for c in candidates}
        total_slots = sum(cap.values())
        known = {a for c in candidates for a in c.state.load.adapters} | set(self._load)
        loads = {a: round(self._load.get(a, 0.0)) for a in known}
        active = sorted(((a, n) for a, n in loads.items() if n > 0), key=lambda x: (-x[1], x[0]))[
            :total_slots
        ]
        total = sum(n for _, n in active)
        counts_by = {}
        if total:
            raw = {a: min(max(math.ceil(n / total * total_slots), 1), len(workers)) for a, n in active}
            s = sum(raw.values())
            scale = min(1.0, total_slots / s) if s else 1.0
            counts_by = {a: max(1, int(r * scale)) for a, r in raw.items()}
        for a in sorted(known):
            ranked = sorted(workers, key=lambda i: (-_hrw(a, i), i))
            old = self._table.get(a)
            if a in counts_by:
                want = counts_by[a]
                if old is not None and old.active and want < len(old.replicas):
                    if self._tick - old.last_scale_down < self.cooldown_ticks:
                        want = len(old.replicas)
                    else:
                        old.last_scale_down = self._tick
                prior = set(old.replicas) if old is not None else set()
                full = {i for i in workers if cap[i] and used[i] >= cap[i]}
                chosen = [i for i in ranked if i in prior and i not in full][:want]
                chosen += [i for i in ranked if i not in chosen and i not in full][: want - len(chosen)]
                if not chosen:
                    chosen = ranked[:want]
                self._table[a] = _Entry(chosen, True, old.last_scale_down if old else 0)
            else:
                self._table[a] = _Entry(ranked[:1], False, old.last_scale_down if old else 0)


# --- rows, runs and the table -------------------------------------------------------------------------------------

#: The table's rows: label -> (policy type, params). The Dynamo rows wrap Dynamo's KV cost in `DynamoLora`: with
#: its default 3 s controller, and with a controller ticking every 0.25 s (as often as Tandem's agents report load):
#: a run spans about 44 s of simulated time, 15 ticks of the default controller, and the faster one shows how much
#: of Dynamo's figure is the controller's period.
ROWS: dict[str, tuple[str, Mapping[str, Any] | None]] = {
    "kv_affinity (adapter-blind)": ("kv_affinity", None),
    "llm-d lora-affinity": ("llm_d", None),
    "dynamo lora": ("dynamo", None),
    "dynamo lora, 0.25 s ticks": ("dynamo", None),
    "tandem lora_affinity": ("lora_affinity", None),
}
TANDEM = "tandem lora_affinity"
BLIND = "kv_affinity (adapter-blind)"


@dataclass
class LoraResult:
    workload: LoraWorkload
    results: dict[str, FleetResult]
    cold_loads: dict[str, int]  # by row, caused by measured requests

    def per_1000(self, label: str) -> float:
        r = self.results[label]
        return self.cold_loads[label] / len(r.ttft_s) * 1000 if r.ttft_s else float("nan")


def run_row(job) -> tuple[FleetResult, int]:
    """One row on one workload (picklable, for process pools)."""
    w, label, lora, engine, word_ids = job
    policy, params = ROWS[label]
    if policy == "lora_affinity":
        params = {
            "cold_load_s": lora.load_s,
            **(params or {}),
        }  # the cold-load time as measured on the engines
    arr = make_arrivals(w, engine, word_ids)
    cfg = FleetConfig(w.instances, policy, params, engine, warmup=w.warmup, seed=w.seed)
    fleet = LoraFleet(cfg, lora, arr.adapter, w.warmup)
    if label.startswith("dynamo lora"):
        tick = 0.25 if "ticks" in label else 3.0
        fleet.policy = DynamoLora(kv=fleet.policy, timestep_s=tick)  # type: ignore[arg-type]
    result = fleet.run(arr.arrivals, _Prompts(arr.prompts))
    return result, fleet.cold_loads


def run(
    workloads: Sequence[LoraWorkload],
    lora: LoraSpec = LoraSpec(),
    engine: EngineSpec | None = None,
    workers: int = 0,
    progress=None,
) -> list[LoraResult]:
    """Every row on every workload."""
    from bench.fleet.runs import _token_ids, run_many

    engine = engine or EngineSpec()
    word_ids = _token_ids()
    jobs = [(w, label, lora, engine, word_ids) for w in workloads for label in ROWS]
    outs = run_many(jobs, workers, progress, run=run_row)
    results = []
    for i, w in enumerate(workloads):
        chunk = outs[i * len(ROWS) : (i + 1) * len(ROWS)]
        results.append(
            LoraResult(
                w,
                {k: r for k, (r, _) in zip(ROWS, chunk, strict=True)},
                {k: n for k, (_, n) in zip(ROWS, chunk, strict=True)},
            )
        )
    return results


def verdict(res: LoraResult) -> str:
    """The goal: Tandem's mean and p99 TTFT >= 25% below every peer's, cold loads >= 5x fewer than the blind row's."""
    t = res.results[TANDEM]
    peers = {k: v for k, v in res.results.items() if k != TANDEM}
    worst_mean = max(t.mean_ttft / r.mean_ttft for r in peers.values())
    worst_p99 = max(t.pct(99) / r.pct(99) for r in peers.values())
    blind, ours = res.per_1000(BLIND), res.per_1000(TANDEM)
    loads_x = blind / ours if ours else float("inf")
    ok = worst_mean <= 0.75 and worst_p99 <= 0.75 and loads_x >= 5
    return (
        f"{'met' if ok else 'missed'} (mean x{worst_mean:.2f}, p99 x{worst_p99:.2f} of the closest peer; "
        f"cold loads {loads_x:.1f}x fewer than adapter-blind)"
    )


def table(results: Sequence[LoraResult]) -> str:
    lines = [
        "| workload | policy | TTFT mean | p99 | cold loads / 1,000 requests | prefix hit rate | goal |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for res in results:
        goal = verdict(res)
        for label, r in res.results.items():
            lines.append(
                f"| {res.workload.label} | {label} | {r.mean_ttft * 1000:.0f} | {r.pct(99) * 1000:.0f} "
                f"| {res.per_1000(label):.0f} | {r.hit_rate:.1%} | {goal if label == TANDEM else ''} |"
            )
    return "\n".join(lines)


def default_workloads(requests: dict[int, int] | None = None, seed: int = 0) -> list[LoraWorkload]:
    """The table's cells: 50 and 500 adapters, 8 and 32 instances, stationary and shifting popularity."""
    requests = requests or {8: 1500, 32: 3000}
    return [
        LoraWorkload(
            adapters=a, instances=n, shifting=s, requests=requests[n], warmup=requests[n] // 10, seed=seed
        )
        for a in (50, 500)
        for n in (8, 32)
        for s in (False, True)
    ]


def summary(results: Sequence[LoraResult]) -> dict[str, Any]:
    return {
        res.workload.label: {
            label: {
                "mean_ttft_ms": round(r.mean_ttft * 1000, 1),
                "p99_ttft_ms": round(r.pct(99) * 1000, 1),
                "cold_loads_per_1000": round(res.per_1000(label), 1),
                "hit_rate": round(r.hit_rate, 4),
            }
            for label, r in res.results.items()
        }
        | {"goal": verdict(res)}
        for res in results
    }
