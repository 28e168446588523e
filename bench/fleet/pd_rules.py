"""P/D rules of the fleet simulator: given a request, its KV facts per instance and the fleet's state, each rule
returns a (prefill, decode) pair, or a decode instance that serves the request alone (local serving: a vLLM decode
engine computes the prompt itself when it gets no `kv_transfer_params`).

A rule is pure apart from its own seeded randomness and the routing memory its real system keeps (SGLang's
approximate tree). It sees candidates built exactly as the coordinator builds them (`coordinator.picker.candidates`:
the workload ledger's figures and the conductor's facts), plus what the simulated fleet reports (`PdView`).

Trigger mode (decode first) asks a rule twice: at arrival (`decode_fixed` None) for the decode instance, or local
serving; when the decode engine has allocated its blocks and calls back, with `decode_fixed` set, for the prefill
instance (the rule must return that decode instance and a prefill one). Handoff asks once.

The peers' rules are reproduced from their sources (each class cites file and version); Tandem's joint choice
(`tandem_joint`) and its per-request disaggregation (`tandem_adaptive`) are the coordinator's own
`coordinator.scheduling.pd_joint`.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bench.fleet.links import Topology
from coordinator.scheduling import Candidate, RequestFacts, create_policy
from coordinator.scheduling.pd_joint import PdJoint
from coordinator.topology import Link, NodeLinks
from coordinator.topology import Topology as JointTopology


@dataclass(frozen=True, slots=True)
class PdChoice:
    """Where a request goes: `decode` always; `prefill` None means the decode instance serves it alone."""

    decode: str
    prefill: str | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


@dataclass
class PdView:
    """What a rule may know about the fleet when it decides."""

    prefill: Sequence[Candidate]  # prefill instances (empty in an aggregated fleet)
    decode: Sequence[Candidate]  # decode instances (every instance in an aggregated fleet)
    node: Mapping[str, int]  # instance id -> node
    #: Free KV blocks per instance as last reported (the engines' `kv_cache_usage` times their pool size).
    free_blocks: Mapping[str, int] = field(default_factory=dict)
    #: Output tokens per second per instance over the last report period (vLLM's generation throughput gauge).
    generation_rate: Mapping[str, float] = field(default_factory=dict)
    decode_fixed: str | None = None  # trigger callback: the decode instance already chosen
    block_size: int = 16
    now: float = 0.0  # simulated time of the decision


class PdRule(Protocol):
    """One P/D rule."""

    name: str
    disaggregates: (
        bool  # False: the fleet is aggregated (every instance hybrid), `decide` never names a prefill
    )

    def decide(self, request: RequestFacts, view: PdView) -> PdChoice: ...


def _by_id(cands: Sequence[Candidate], iid: str) -> Candidate:
    for c in cands:
        if c.instance_id == iid:
            return c
    raise ValueError(f"decode_fixed {iid!r} is not a decode candidate")


class _Independent:
    """Prefill and decode chosen by two policies, each on its own pool (how SGLang's PD router, MindIE-Motor and
    Tandem today choose); `local` may keep a request on its decode instance."""

    name = ""
    disaggregates = True

    def __init__(self, prefill_policy, decode_policy) -> None:
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy

    def pick_decode(self, request: RequestFacts, view: PdView) -> Candidate:
        if view.decode_fixed is not None:
            return _by_id(view.decode, view.decode_fixed)
        return self.decode_policy.pick(request, view.decode)

    def local(self, request: RequestFacts, decode: Candidate, view: PdView) -> bool:
        return False

    def decide(self, request: RequestFacts, view: PdView) -> PdChoice:
        decode = self.pick_decode(request, view)
        if view.decode_fixed is None and self.local(request, decode, view):
            return PdChoice(decode.instance_id)
        return PdChoice(decode.instance_id, self.prefill_policy.pick(request, view.prefill).instance_id)


class Aggregated:
    """`aggregated`: Tandem's default policy (`kv_affinity`, its defaults) over every instance, all hybrid."""

    name = "aggregated"
    disaggregates = False

    def __init__(self) -> None:
        self.policy = create_policy("kv_affinity", None)

    def decide(self, request: RequestFacts, view: PdView) -> PdChoice:
        return PdChoice(self.policy.pick(request, view.decode).instance_id)


class TandemLeastLoad(_Independent):
    """`tandem_least_load`: Tandem today (`coordinator/picker.py`): prefill by the configured policy (`kv_affinity`,
    its defaults), decode by `least_load` (`scheduler.decode_policy`'s default); always disaggregated."""

    name = "tandem_least_load"

    def __init__(self) -> None:
        super().__init__(create_policy("kv_affinity", None), create_policy("least_load", None))


class Dynamo(_Independent):
    """`dynamo`: NVIDIA Dynamo's disaggregated serving. The frontend's KV router chooses the decode worker and the
    `PrefillRouter` chooses the prefill worker with a KV router too (both: Dynamo's KV cost, `coordinator.scheduling
    .dynamo`, its defaults; docs/design_docs/disagg_serving.md, 2026). Conditional disaggregation: the prefill goes
    remote only when `prefill_length - prefix_hit_length > max_local_prefill_length`, the hit being the decode
    worker's (`lib/llm/src/disagg_router.rs`, `DisaggregatedRouter::prefill_remote`); the shipped default is 1000
    tokens (`examples/python_rs/llm/vllm_nixl/router/disagg_router.py`, `max_local_prefill_length=1000`)."""

    name = "dynamo"

    def __init__(self, max_local_prefill_length: int = 1000) -> None:
        super().__init__(create_policy("dynamo", None), create_policy("dynamo", None))
        self.max_local_prefill_length = max_local_prefill_length

    def local(self, request: RequestFacts, decode: Candidate, view: PdView) -> bool:
        hit = min(decode.match.matched_tokens, request.isl)
        return request.isl - hit <= self.max_local_prefill_length


class LlmD(_Independent):
    """`llm_d`: llm-d's P/D scheduling (llm-d-inference-scheduler, `pkg/plugins/profile/pd_profile_handler.go` and
    `prefix_based_pd_decider.go`, commit 06c08c0, 2026). The decode profile runs first with the prefix scorer and
    the load scorers (`coordinator.scheduling.llm_d`, its default weights 3/2/2); the decider then looks at the
    chosen decode endpoint: with `nonCachedTokens` > 0 a prompt shorter than it, or whose part not cached on that
    endpoint is shorter than it, is served there alone; the shipped default `nonCachedTokens` is 0, which always
    disaggregates. The prefill profile scores prefix only (llm-d's P/D guide's prefill profile)."""

    name = "llm_d"

    def __init__(self, non_cached_tokens: int = 0) -> None:
        prefill = create_policy("llm_d", {"kv_utilization_weight": 0.0, "queue_weight": 0.0})
        super().__init__(prefill, create_policy("llm_d", None))
        if non_cached_tokens < 0:
            raise ValueError(f"llm_d.non_cached_tokens: must be >= 0, got {non_cached_tokens}")
        self.non_cached_tokens = non_cached_tokens

    def local(self, request: RequestFacts, decode: Candidate, view: PdView) -> bool:
        n = self.non_cached_tokens
        if n <= 0:
            return False
        if request.isl < n:
            return True
        return request.isl - min(decode.match.matched_tokens, request.isl) < n


class SGLang(_Independent):
    """`sglang`: SGLang's PD router (sgl-router `--pd-disaggregation`, 2026): prefill and decode chosen
    independently, `--prefill-policy` and `--decode-policy` both defaulting to the router's `--policy`,
    `cache_aware` (log of a shipped router: `prefill_policy: None, decode_policy: None | policy: CacheAware
    { cache_threshold: 0.3, balance_abs_threshold: 64, balance_rel_threshold: 1.5 }`); each side keeps its own
    approximate tree (`coordinator.scheduling.sglang_cache_aware`, `tree: routed`). Always disaggregated."""

    name = "sglang"

    def __init__(self) -> None:
        super().__init__(create_policy("sglang_cache_aware", None), create_policy("sglang_cache_aware", None))


class Motor(_Independent):
    """`motor`: MindIE-Motor's P/D scheduling as described by the issue: cache affinity on prefill (here Tandem's
    `kv_affinity`, its defaults) and token load on decode: the decode instance with the fewest committed tokens in
    flight (context plus output still to come), ties by requests in flight, then id. Always disaggregated."""

    name = "motor"

    def __init__(self) -> None:
        super().__init__(create_policy("kv_affinity", None), None)

    def pick_decode(self, request: RequestFacts, view: PdView) -> Candidate:
        if view.decode_fixed is not None:
            return _by_id(view.decode, view.decode_fixed)
        return min(view.decode, key=lambda c: (c.context_tokens + c.decode_tokens, c.inflight, c.instance_id))


class AIBrix:
    """`aibrix`: AIBrix's `pd` routing algorithm (vllm-project/aibrix `pkg/plugins/gateway/algorithms/
    pd_disaggregation.go`, commit 0169276, 2026), rolesets being the simulated nodes when every node holds both
    roles, else the whole fleet (a StormService roleset groups prefill and decode pods that serve together):
    - prefill imbalance: if max - min in-flight prefill requests > 32, the least-loaded prefill instance, and decode
      candidates restricted to its roleset;
    - decode imbalance (`AIBRIX_DECODE_MAX_REQUEST` 32, `AIBRIX_DECODE_MAX_THROUGHPUT` 2048): if some decode
      instance runs no request or max - min running >= 32, the one with fewest running; else if the generation
      throughputs differ by more than 2048 tok/s, the slowest one; prefill candidates restricted to its roleset;
    - prefill score `(100 - match%) * 0.1 + reqs / max_reqs` (lower is better), skipping instances whose request
      count exceeds mean + 1 std (`defaultStandardDeviationFactor` 1, prefix_cache.go); the best per roleset;
    - decode score `(running / max_running + 1 - tput / max_tput) / (free% / max_free%)`; the best per roleset;
    - the roleset minimising prefill / max_prefill + decode / max_decode wins. No transfer cost, no local serving.
    The match percentage comes from the conductor's facts (AIBrix keeps its own routed prefix table; with KV-event
    sync on it reads the engines' events, as here)."""

    name = "aibrix"
    disaggregates = True

    def __init__(self, seed: int = 0, max_request: float = 32, max_throughput_diff: float = 2048) -> None:
        self._random = random.Random(seed)
        self.max_request = max_request
        self.max_throughput_diff = max_throughput_diff

    def decide(self, request: RequestFacts, view: PdView) -> PdChoice:
        prefill, decode = list(view.prefill), list(view.decode)
        if view.decode_fixed is not None:
            decode = [_by_id(decode, view.decode_fixed)]
        # Rolesets: the nodes, when every node holds both roles; else the whole fleet is one roleset.
        pre_nodes = {view.node[c.instance_id] for c in view.prefill}
        dec_nodes = {view.node[c.instance_id] for c in view.decode}
        node = view.node if pre_nodes == dec_nodes else dict.fromkeys(view.node, 0)
        pre_reqs = {c.instance_id: c.inflight for c in prefill}
        lo, hi = min(pre_reqs.values()), max(pre_reqs.values())
        if hi - lo > 32:
            target = self._random.choice(sorted(i for i, v in pre_reqs.items() if v == lo))
            prefill = [c for c in prefill if c.instance_id == target]
            if view.decode_fixed is None:
                decode = [c for c in decode if node[c.instance_id] == node[target]] or decode
        running = {c.instance_id: float(c.inflight) for c in decode}
        tput = {c.instance_id: view.generation_rate.get(c.instance_id, 0.0) for c in decode}
        free = {}
        for c in decode:
            f = round(100 - c.state.load.kv_cache_usage * 100)
            free[c.instance_id] = f if f > 0 else 0.1
        max_run, max_tput, max_free = (
            max(1.0, *running.values()),
            max(1.0, *tput.values()),
            max(1.0, *free.values()),
        )
        min_run_id = min(decode, key=lambda c: (running[c.instance_id], c.instance_id)).instance_id
        min_tput_id = min(decode, key=lambda c: (tput[c.instance_id], c.instance_id)).instance_id
        chosen_decode = None
        min_run = running[min_run_id]
        if view.decode_fixed is None and (
            min_run == 0 or max(running.values()) - min_run >= self.max_request
        ):
            chosen_decode = min_run_id
        elif view.decode_fixed is None and max(tput.values()) - tput[min_tput_id] > self.max_throughput_diff:
            chosen_decode = min_tput_id
        if chosen_decode is not None:
            decode = [c for c in decode if c.instance_id == chosen_decode]
            if len(prefill) > 1:
                prefill = [c for c in prefill if node[c.instance_id] == node[chosen_decode]] or prefill
        # Prefill scores per roleset.
        counts = [float(c.inflight) for c in prefill]
        max_reqs = max(1.0, *counts)
        mean = statistics.fmean(counts)
        std = statistics.pstdev(counts) if len(counts) > 1 else 0.0
        pre_best: dict[int, tuple[float, Candidate]] = {}
        max_pre = 1.0
        for c in prefill:
            if c.inflight > mean + 1 * std:
                continue
            blocks = math.ceil(request.isl / view.block_size) if request.isl else 0
            pct = int(100 * c.match.npu_blocks / blocks) if blocks else 0
            score = (100 - pct) * 0.1 + c.inflight / max_reqs
            rs = node[c.instance_id]
            if rs not in pre_best or score < pre_best[rs][0]:
                pre_best[rs] = (score, c)
            max_pre = max(max_pre, score)
        dec_best: dict[int, tuple[float, Candidate]] = {}
        max_dec = 0.01
        for c in decode:
            i = c.instance_id
            score = (running[i] / max_run + 1 - tput[i] / max_tput) / (free[i] / max_free)
            rs = node[i]
            if rs not in dec_best or score < dec_best[rs][0]:
                dec_best[rs] = (score, c)
            max_dec = max(max_dec, score)
        best = None
        for rs, (ps, pc) in sorted(pre_best.items()):
            if rs not in dec_best:
                continue
            ds, dc = dec_best[rs]
            total = ps / max_pre + ds / max_dec
            if best is None or total < best[0]:
                best = (total, pc, dc)
        if (
            best is None
        ):  # no roleset holds both (AIBrix errors out): least-loaded of each, so the run goes on
            pc = min(prefill, key=lambda c: (c.inflight, c.instance_id))
            dc = min(decode, key=lambda c: (running[c.instance_id], c.instance_id))
            return PdChoice(dc.instance_id, pc.instance_id)
        return PdChoice(best[2].instance_id, best[1].instance_id)


class TandemJoint:
    """`tandem_joint`: Tandem's joint choice (`coordinator.scheduling.pd_joint`, `scheduler.pd_choice: joint`, its
    defaults): the prefill instance by `kv_affinity` (its defaults, as the coordinator passes its configured policy)
    and the decode instance for it with the lowest predicted TTFT, the KV transfer over the simulated topology's
    links included; at a trigger callback, the best prefill instance for the decode instance waiting.
    Step costs are the coordinator's prior (Llama-3.1-8B on a 910B, as the simulated engines' profile), the links
    the simulator's defaults (`bench.fleet.links.Topology`)."""

    name = "tandem_joint"
    disaggregates = True
    local = False

    def __init__(self) -> None:
        sim = Topology()
        links = NodeLinks(
            intra=Link(sim.intra_bandwidth, sim.intra_latency_s),
            nic=Link(sim.nic_bandwidth, sim.nic_latency_s),
        )
        self._now = 0.0
        self.policy = create_policy("kv_affinity", None)  # the prefill instance's (the mesh's default policy)
        self.pair = PdJoint(topology=JointTopology(default=links), local=self.local, clock=lambda: self._now)
        self._node: Mapping[str, int] = {}
        self.pair.node_of = lambda c: f"n{self._node[c.instance_id]}"

    def decide(self, request: RequestFacts, view: PdView) -> PdChoice:
        self._now, self._node = view.now, view.node
        if view.decode_fixed is not None:
            choice = self.pair.prefill_for(request.isl, view.prefill, _by_id(view.decode, view.decode_fixed))
        else:
            choice = self.pair.choose(
                request.isl,
                view.prefill,
                view.decode,
                prefill_pick=lambda cands: self.policy.pick(request, cands),
            )
        if choice.prefill is None:
            return PdChoice(choice.decode.instance_id)
        self.pair.sent(choice)
        return PdChoice(choice.decode.instance_id, choice.prefill.instance_id)


class TandemAdaptive(TandemJoint):
    """`tandem_adaptive`: the joint choice that may serve a request on a decode instance alone
    (`scheduler.pd_choice: adaptive`) when that is predicted sooner and its prefill keeps the decoding sequences there
    within the ITL bound (`pd_joint.Params.itl_bound_s`)."""

    name = "tandem_adaptive"
    local = True


#: Every rule of the simulator, by name.
RULES: dict[str, Callable[[], PdRule]] = {
    "aggregated": Aggregated,
    "dynamo": Dynamo,
    "llm_d": LlmD,
    "sglang": SGLang,
    "aibrix": AIBrix,
    "motor": Motor,
    "tandem_least_load": TandemLeastLoad,
    "tandem_joint": TandemJoint,
    "tandem_adaptive": TandemAdaptive,
}


def create_rule(name: str) -> PdRule:
    """A fresh rule by name; ValueError naming the known ones."""
    try:
        return RULES[name]()
    except KeyError:
        raise ValueError(f"unknown P/D rule {name!r} (known: {', '.join(RULES)})") from None
