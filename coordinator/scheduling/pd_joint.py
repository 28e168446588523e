"""`pd_joint`: the prefill and decode instances of a P/D request chosen together, by predicted TTFT, and, in its
adaptive form, whether to disaggregate the request at all (pure core).

For a pair (P, D), with the learned step costs of each (`coordinator.latency`; the prior where none is learned):

    ttft(P, D) = prefill(P) + transfer(P -> D) + first_step(D)

- `prefill(P)`: `latency.ttft_s` on P: its queued prefill plus this prompt's tokens P has not cached (the
  conductor's exclusive tiers, as aggregated scoring counts them);
- `transfer(P -> D)`: the KV of the prompt tokens D does not hold already (vLLM's decode side pulls only the blocks
  its own prefix cache lacks), `kv_bytes_per_token` each, over the link between their nodes
  (`coordinator.topology`) shared with the transfers already in flight on it;
- `first_step(D)`: one decode step of D's batch with this request added (`latency.tpot_s`).

A decode instance whose KV cache is fuller than `max_kv_usage` (its engine's `vllm:kv_cache_usage_perc`) cannot
take the request and is not a candidate (unless every one is that full: then the least full ones are).

The coordinator passes its configured policy's pick as `prefill_pick`: P is the instance that policy chooses
(`kv_affinity`'s cache ownership and replication rules keep prefixes where they live; a greedy `prefill(P)` copies
them to idle instances and lost 2x in mean TTFT at 90% load in the fleet simulator, docs/pd.md), and D is the decode
instance with the lowest `transfer(P -> D) + first_step(D)`. Without it (a caller with no policy), every pair is
scored.

With `local` (the adaptive form, `scheduler.pd_choice: adaptive`), serving the request on a decode instance alone (no transfer, vLLM decodes
a request that comes without `kv_transfer_params` itself) is a candidate too, at

    ttft_local(D) = latency.ttft_s(D)  +  interference * prefill_time(D)    (second term only while D decodes)

where the second term charges the stall the prefill puts into the inter-token gap of the sequences decoding
there (each waits about the prefill's time once): the local choice wins for short uncached prompts (no transfer,
no second engine's step), prompts mostly cached on a decode instance, and when the prefill pool is saturated
while a decode instance has slack. It is a candidate only while the step that carries the prefill (D's queued
prefill and this prompt's uncached tokens, at most `step_budget`) keeps the gap between two tokens of the
sequences decoding on D within `itl_bound_s` (vLLM puts a prompt of up to the budget into one step): P/D's promise
is that a prefill never stalls decoding, and without the bound the local choice broke it at load (ITL p99 of
53-261 ms against 21-47 ms for the always-disaggregated rules in the fleet simulator, docs/pd.md).

A pair whose KV transfer failed lately (its decode engine's failed-transfer counter rose, attributed to the pair by
`coordinator.link_health`) comes after every other pair, and after serving locally, for `link_cooldown_s`: the
decode engine recomputed that prompt, and a broken link would fail the next one too.

LoRA: a request for an adapter needs it on both legs (the prefill engine computes the prompt's KV with it, the
decode engine decodes with it). Each leg that does not hold the adapter (`EngineLoad.adapters`) adds
`adapter_load_s` to the pair's TTFT (it loads it first), and `adapter_wait_s` instead when every one of its slots
holds an adapter with requests in flight (the request waits for one to drain): a pair holding the adapter on both
sides wins unless the other is faster by more than those loads. The conductor's match of each leg is the
adapter's own (`RequestFacts.adapter`, `tandem.chain_hash.adapter_root`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.latency import DEFAULT_PRIOR, StepCosts, tpot_s, ttft_s
from coordinator.link_health import COOLDOWN_S, LinkHealth
from coordinator.scheduling.interface import Candidate
from coordinator.scheduling.lora_affinity import slots
from coordinator.scheduling.params import parse_params
from coordinator.topology import Topology, Transfers

TYPE = "pd_joint"


#: Token budget per engine step (vLLM `--max-num-batched-tokens`) when no other is configured.
STEP_BUDGET = 8192


@dataclass(frozen=True, slots=True)
class Params:
    """See the module docstring."""

    #: KV bytes per prompt token (Llama-3.1-8B in BF16: 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes).
    kv_bytes_per_token: int = 131072
    max_kv_usage: float = 0.95
    interference: float = 1.0
    #: Token budget per engine step (vLLM `--max-num-batched-tokens`), for the steps a prefill takes.
    step_budget: int = STEP_BUDGET
    #: Seconds a leg takes to load a LoRA adapter it does not hold (measured on the engines).
    adapter_load_s: float = 0.25
    #: Seconds charged to a leg whose adapter slots are all busy (the request waits for one to drain).
    adapter_wait_s: float = 1.0
    #: Seconds a pair blamed for a failed KV transfer is left out while another choice exists
    #: (`coordinator.link_health`); 0: never left out.
    link_cooldown_s: float = COOLDOWN_S
    #: Serving locally is a choice only while the step carrying its prefill keeps the gap between two tokens of the
    #: sequences decoding there within this many seconds (0: no bound).
    itl_bound_s: float = 0.05

    def check(self) -> str | None:
        if not 0 < self.max_kv_usage <= 1:
            return f"max_kv_usage: must be in (0, 1], got {self.max_kv_usage}"
        if self.kv_bytes_per_token < 1:
            return f"kv_bytes_per_token: must be >= 1, got {self.kv_bytes_per_token}"
        if self.link_cooldown_s < 0:
            return f"link_cooldown_s: must be >= 0, got {self.link_cooldown_s}"
        if self.itl_bound_s < 0:
            return f"itl_bound_s: must be >= 0, got {self.itl_bound_s}"
        return None


@dataclass(frozen=True, slots=True)
class PairChoice:
    """Where a P/D request goes: `prefill` None means served by `decode` alone."""

    prefill: Candidate | None
    decode: Candidate
    ttft_s: float  # predicted
    transfer_s: float  # predicted KV transfer time (0 when local)
    transfer_tokens: int  # prompt tokens whose KV moves (0 when local)
    cross_node: bool  # the transfer leaves the prefill instance's node


def _costs(c: Candidate) -> StepCosts:
    return c.costs if c.costs is not None else DEFAULT_PRIOR


def _batch(c: Candidate) -> tuple[int, float]:
    """Sequences decoding on a candidate and their mean context (its legs in flight through this coordinator)."""
    return c.inflight, (c.context_tokens / c.inflight if c.inflight else 0.0)


def _uncached(c: Candidate, isl: int) -> int:
    return max(0, isl - min(c.match.matched_tokens, isl))


def prefill_s(c: Candidate, isl: int, step_budget: int = STEP_BUDGET) -> float:
    """Predicted time until `c` has computed a prompt of `isl` tokens, its queue included (`latency.ttft_s` on its
    queued prefill, the prompt's uncached tokens, its decoding batch unless it is a prefill instance, and its
    learned step costs)."""
    batch, context = _batch(c) if c.state.info.role != "prefill" else (0, 0.0)
    return ttft_s(_costs(c), c.prefill_tokens, _uncached(c, isl), batch, context, step_budget)


class PdJoint:
    """See the module docstring."""

    name = TYPE
    needs_match = True
    uses_predictions = True

    def __init__(
        self,
        params: Params = Params(),
        topology: Topology | None = None,
        local: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.params = params
        self.topology = topology or Topology()
        self.local = local
        self.clock = clock
        self.transfers = Transfers()
        #: Pairs blamed for failed KV transfers (the decode engines' failure counters, attributed).
        self.links = LinkHealth(cooldown_s=params.link_cooldown_s)
        #: Where a candidate sits (its registered node; the fleet simulator maps its own).
        self.node_of: Callable[[Candidate], str] = lambda c: c.state.info.node_id

    def prefill_s(self, c: Candidate, isl: int) -> float:
        """Predicted time until `c` has computed this prompt (queue included)."""
        return prefill_s(c, isl, self.params.step_budget)

    def first_step_s(self, d: Candidate, isl: int) -> float:
        """Predicted time of `d`'s first decode step with this request in its batch."""
        batch, context = _batch(d)
        return tpot_s(_costs(d), batch, context, isl)

    def transfer(self, p: Candidate, d: Candidate, isl: int) -> tuple[float, int, bool]:
        """Predicted transfer time P -> D, the tokens moved, and whether it crosses nodes."""
        tokens = _uncached(d, isl)
        link, keys = self.topology.link(self.node_of(p), self.node_of(d))
        cross = self.topology.cross_node(self.node_of(p), self.node_of(d))
        if not tokens:
            return 0.0, 0, cross
        nbytes = tokens * self.params.kv_bytes_per_token
        return link.seconds(nbytes, self.transfers.sharing(keys, self.clock())), tokens, cross

    def local_s(self, d: Candidate, isl: int) -> float:
        """Predicted cost of serving the request on `d` alone: its TTFT plus the stall charged to its batch."""
        costs = _costs(d)
        batch, context = _batch(d)
        own = costs.prefill * _uncached(d, isl)
        ttft = ttft_s(costs, d.prefill_tokens, _uncached(d, isl), batch, context, self.params.step_budget)
        return ttft + (self.params.interference * own if batch else 0.0)

    def local_gap_s(self, d: Candidate, isl: int) -> float:
        """The gap between two tokens of the sequences decoding on `d` while the step carries this request's prefill
        (its queued prefill first, at most a step's token budget; 0 when nothing decodes there)."""
        batch, context = _batch(d)
        if not batch:
            return 0.0
        costs = _costs(d)
        work = min(self.params.step_budget, d.prefill_tokens + _uncached(d, isl))
        return costs.prefill * work + costs.step_s(batch, context)

    def decode_pool(self, decodes: Sequence[Candidate]) -> list[Candidate]:
        """Decode candidates with room in their KV cache (the least full ones when none has)."""
        limit = self.params.max_kv_usage
        roomy = [d for d in decodes if d.state.load.kv_cache_usage < limit]
        if roomy:
            return roomy
        least = min(d.state.load.kv_cache_usage for d in decodes)
        return [d for d in decodes if d.state.load.kv_cache_usage == least]

    def adapter_s(self, c: Candidate, adapter: str) -> float:
        """What getting `adapter` onto `c` adds to the request's TTFT (0 for the base model or where it is held)."""
        if not adapter:
            return 0.0
        view = slots(c, adapter)
        if view.resident:
            return 0.0
        return self.params.adapter_wait_s if view.blocked else self.params.adapter_load_s

    def choose(
        self,
        isl: int,
        prefills: Sequence[Candidate],
        decodes: Sequence[Candidate],
        adapter: str = "",
        prefill_pick: Callable[[Sequence[Candidate]], Candidate] | None = None,
    ) -> PairChoice:
        """The pair (or, with `local`, the lone decode instance) with the lowest predicted TTFT; ties go to the
        instance ids in order. At least one decode candidate is required; without prefill candidates the request
        is served locally. `adapter`: the LoRA adapter both legs need ("" for the base model). `prefill_pick`: the
        prefill instance is this pick among the prefill candidates (the configured policy's, as the coordinator
        passes it), leaving out one whose links to every decode candidate failed lately; the decode instance is then
        chosen for it among all decode candidates. Without it every pair is scored."""
        if not decodes:
            raise ValueError("choose needs at least one decode candidate")
        pool = self.decode_pool(decodes)
        now = self.clock()
        for dc in pool:
            self._observe(dc, now)
        best: tuple[tuple[bool, float, str, str], PairChoice] | None = None
        linked = self._linked(prefills, pool, now)
        scored = [prefill_pick(linked)] if prefill_pick is not None and linked else linked
        for pc in scored:
            before = self.prefill_s(pc, isl) + self.adapter_s(pc, adapter)
            for dc in pool:
                moved_s, tokens, cross = self.transfer(pc, dc, isl)
                ttft = before + moved_s + self.first_step_s(dc, isl) + self.adapter_s(dc, adapter)
                # A pair blamed for a failed transfer comes after every other choice.
                key = (
                    self.links.avoided(pc.instance_id, dc.instance_id, now),
                    ttft,
                    pc.instance_id,
                    dc.instance_id,
                )
                if best is None or key < best[0]:
                    best = (key, PairChoice(pc, dc, ttft, moved_s, tokens, cross))
        if self.local or not prefills:
            bound = self.params.itl_bound_s if prefills else 0.0
            for dc in pool:
                if bound and self.local_gap_s(dc, isl) > bound:
                    continue
                cost = self.local_s(dc, isl) + self.adapter_s(dc, adapter)
                key = (False, cost, "", dc.instance_id)
                if best is None or key < best[0]:
                    best = (key, PairChoice(None, dc, cost, 0.0, 0, False))
        assert best is not None
        return best[1]

    def prefill_for(self, isl: int, prefills: Sequence[Candidate], decode: Candidate) -> PairChoice:
        """The prefill instance for a decode instance already chosen (trigger mode's callback, a retried handoff
        leg): the lowest `prefill(P) + transfer(P -> D)`; never local (the decode engine is already waiting)."""
        if not prefills:
            raise ValueError("prefill_for needs at least one prefill candidate")
        now = self.clock()
        self._observe(decode, now)
        best: tuple[tuple[bool, float, str], PairChoice] | None = None
        for pc in prefills:
            moved_s, tokens, cross = self.transfer(pc, decode, isl)
            ttft = self.prefill_s(pc, isl) + moved_s + self.first_step_s(decode, isl)
            key = (self.links.avoided(pc.instance_id, decode.instance_id, now), ttft, pc.instance_id)
            if best is None or key < best[0]:
                best = (key, PairChoice(pc, decode, ttft, moved_s, tokens, cross))
        assert best is not None
        return best[1]

    def _linked(
        self, prefills: Sequence[Candidate], decodes: Sequence[Candidate], now: float
    ) -> list[Candidate]:
        """The prefill candidates with a link to some decode candidate not blamed for a failed transfer (all of
        them when none has)."""
        ok = [
            c
            for c in prefills
            if not all(self.links.avoided(c.instance_id, d.instance_id, now) for d in decodes)
        ]
        return ok or list(prefills)

    def _observe(self, d: Candidate, now: float) -> None:
        load = d.state.load
        self.links.observe(d.instance_id, load.kv_transfers, load.kv_transfer_failures, now)

    def sent(self, choice: PairChoice) -> None:
        """The pair's prefill leg is on its way: its transfer shares its link until it is predicted done."""
        if choice.prefill is None:
            return
        self.links.sent(choice.prefill.instance_id, choice.decode.instance_id, self.clock())
        if not choice.transfer_tokens:
            return
        _, keys = self.topology.link(self.node_of(choice.prefill), self.node_of(choice.decode))
        self.transfers.start(keys, self.clock() + choice.ttft_s)


def create(
    raw: Mapping[str, Any] | None = None, topology: Topology | None = None, local: bool = False
) -> PdJoint:
    """A joint chooser from raw parameters (`local`: the adaptive form)."""
    return PdJoint(parse_params(Params, raw, TYPE), topology, local)
