"""The endpoint picker: from an understood request (`coordinator.understanding`) to the instances that serve it,
with their workload committed.

Pure core apart from the awaited conductor match: the decision paths (`coordinator.decision`) feed it requests and
turn its picks (or `OpenAIError`s) into Envoy replies.

Modes, per model (`coordinator.pd_mode`; `auto` picks P/D when the model has prefill or decode instances):
- aggregated: one hybrid instance, chosen by the configured policy;
- prefill_handoff_decode: a decode instance chosen by the decode policy (`scheduler.decode_policy`, least load
  by default: its KV arrives from the prefill engine), and a prefill instance chosen by the configured policy for
  each prefill attempt (`pick_prefill`);
- concurrent_engine_sync (trigger): the same picks, but the prefill instance is chosen when the decode engine
  calls the metaserver back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from coordinator import metrics
from coordinator.adapter_placement import AdapterHolds, adapter_candidates
from coordinator.config import CoordinatorConfig, PdMode
from coordinator.decision_log import Components, DecisionLog, components
from coordinator.errors import OpenAIError
from coordinator.instances import InstanceState, InstanceTable
from coordinator.kv_match import ConductorMatcher
from coordinator.latency import LatencyBook
from coordinator.predicted_cache import PredictedCache
from coordinator.scheduling import NO_MATCH, Candidate, KvMatch, Policy, RequestFacts
from coordinator.scheduling.params import parse_params
from coordinator.scheduling.pd_joint import PairChoice, PdJoint, prefill_s
from coordinator.scheduling.pd_joint import Params as PairParams
from coordinator.scheduling.pd_joint import create as create_pair
from coordinator.understanding import OpenAIRequest, TokenizerCache, understand_body
from coordinator.workload import Commitment, WorkloadLedger
from tandem import tracing
from tandem.chain_hash import adapter_root, chain_hashes

log = logging.getLogger(__name__)

#: The P/D mode of a model whose prefill and decode instances all have one dispatch capability.
_MODE_OF_DISPATCH = {"handoff": PdMode.HANDOFF, "trigger": PdMode.TRIGGER}


class AsksFacts(Protocol):
    """What the picker reads of a policy (or the joint P/D chooser) to ask the conductor and predict the cache."""

    needs_match: bool
    uses_predictions: bool


@dataclass(slots=True)
class Leg:
    """One instance a request uses, with the workload committed there and the KV facts it was chosen on."""

    instance: InstanceState
    commitment: Commitment
    match: KvMatch = NO_MATCH


@dataclass(slots=True)
class Pick:
    """The picker's answer for one request: where it goes and what it holds until it ends (the decision path,
    `coordinator.decision.Decider`, turns it into Envoy's reply)."""

    request: OpenAIRequest
    request_id: str
    mode: PdMode  # never AUTO: the mode `mode_of` resolved for the request's model
    target: Leg  # where Envoy forwards the request: the aggregated engine, or the decode engine
    matches: dict[str, KvMatch] | None = None  # conductor facts for the prefill pool (handoff), asked once
    hashes: tuple[int, ...] = ()  # the first prompt's chain hashes (prefill pool's block size), when asked
    fallback: str | None = (
        None  # `host:port` of a second engine for Envoy's retry (aggregated, `static` cluster)
    )
    #: Joint P/D choice (`scheduler.pd_choice`): the pair it chose (`planned.prefill` None: served by the decode
    #: instance alone, `mode` then AGGREGATED); None under `separate`.
    planned: PairChoice | None = None
    #: The target's predicted time to first token when it was chosen (`predicted_ttft_s`; the pair's under a
    #: joint choice): the routing-quality SLI compares it with what Envoy saw (`coordinator.routing_quality`).
    predicted_ttft_s: float = 0.0

    @property
    def facts(self) -> RequestFacts:
        r = self.request
        return RequestFacts(self.request_id, r.model, r.prompt_tokens, r.max_tokens, self.hashes, r.adapter)


def candidates(
    states: Sequence[InstanceState],
    ledger: WorkloadLedger,
    matches: dict[str, KvMatch] | None,
    latency: LatencyBook | None = None,
) -> list[Candidate]:
    """The policy's view of some instances: the ledger's figures, the conductor's facts and the learned step costs
    for each."""
    matches = matches or {}
    return [
        Candidate(
            s,
            ledger.prefill_tokens(iid),
            ledger.decode_tokens(iid),
            ledger.requests(iid),
            ledger.context_tokens(iid),
            matches.get(iid, NO_MATCH),
            latency.costs(iid) if latency is not None else None,
        )
        for s in states
        for iid in (s.info.instance_id,)
    ]


def candidate_attributes(cands: Sequence[Candidate], chosen: Candidate | None, isl: int) -> dict[str, object]:
    """Each candidate's score components (`decision_log.components`, as `Admin/ListDecisions` lists them) as span
    attributes (`tandem.candidate.<id>.<component>`) and the choice: what an operator reads to see why a request
    went where it went."""
    out: dict[str, object] = {}
    for c in cands:
        key = f"tandem.candidate.{c.instance_id}"
        for name, value in zip(Components._fields, components(c, isl), strict=True):
            out[f"{key}.{name}"] = value
    if chosen is not None:
        out["tandem.chosen"] = chosen.instance_id
    return out


def _named(request: OpenAIRequest) -> str:
    if request.adapter:
        return f"the adapter `{request.adapter}` of `{request.model}`"
    return f"the model `{request.model}`"


class EndpointPicker:
    """Schedules and commits workload for one request at a time (understanding its body first, with
    `coordinator.understanding`, when the caller has not)."""

    def __init__(
        self,
        config: CoordinatorConfig,
        instances: InstanceTable,
        ledger: WorkloadLedger,
        policy: Policy,
        tokenizers: TokenizerCache,
        matcher: ConductorMatcher | None = None,
        predicted: PredictedCache | None = None,
        fallbacks: bool = False,
        decode_policy: Policy | None = None,
    ) -> None:
        self.config = config
        self.instances = instances
        self.ledger = ledger
        #: Each instance's step costs, learned from its progress (`coordinator.latency`): the time model that
        #: predictions of TTFT and TPOT use.
        self.latency = LatencyBook()
        self.policy = policy  # aggregated instances and P/D prefill instances
        #: P/D decode instances: a policy like any other, seeing the decode candidates' loads and, when it asks, the
        #: conductor's facts for them (`scheduler.decode_policy`).
        self.decode_policy = decode_policy or config.scheduler.build_decode()
        #: The joint (prefill, decode) choice, when `scheduler.pd_choice` is `joint` or `adaptive`.
        choice = config.scheduler.pd_choice
        #: Where instances sit and their links (`coordinator.topology`): the joint choice's costs, and the scope of
        #: the KV every P/D pair moves (`kv_moved`) under any `pd_choice`.
        self.topology = config.topology.build()
        self.pair: PdJoint | None = None
        if choice != "separate":
            self.pair = create_pair(config.scheduler.pd_joint, self.topology, local=choice == "adaptive")
        #: KV bytes per prompt token (`scheduler.pd_joint.kv_bytes_per_token`).
        self.kv_bytes_per_token = parse_params(
            PairParams, config.scheduler.pd_joint, "pd_joint"
        ).kv_bytes_per_token
        self.tokenizers = tokenizers
        self.matcher = matcher
        self.predicted = predicted  # prompts just routed count as cached until KV events confirm them
        #: Name a second engine with each aggregated pick, for Envoy's one retry before any response byte (the
        #: `static` engines cluster tries the named addresses in order; ORIGINAL_DST could only retry the first).
        self.fallbacks = fallbacks
        #: Context length per model, from the mesh file's `models[].max_model_len` (checked when known).
        self.max_model_len: dict[str, int] = {}
        #: The last scorings with their candidates, for `Admin/ListDecisions` (`coordinator.recent_decisions`).
        self.decisions = DecisionLog(config.recent_decisions)
        #: LoRA adapters by name -> their base model, from the mesh file's `models[].adapters`: a request naming
        #: one is served by the base model's instances, the engine given the adapter's name as `model`.
        self.adapters: dict[str, str] = {}
        #: Instances not to be chosen for an adapter for now (a load of it there failed: `adapter_placement`);
        #: None when the coordinator places no adapters.
        self.placement: AdapterHolds | None = None

    def understand(self, api: str, raw_body: bytes) -> OpenAIRequest:
        """`understanding.understand_body` with this picker's models and adapters; 400 for bad input, 404 for an
        unknown model or adapter."""
        return understand_body(
            api,
            raw_body,
            self.instances.known_models,
            self.tokenizers,
            self.config,
            self.max_model_len,
            self.adapters,
        )

    def mode_of(self, model: str) -> PdMode:
        """The serving mode of `model`: `pd_mode`, or under `auto` what its instances' roles and dispatch
        capabilities say; 503 when its P/D instances mix handoff-only and trigger-only capability."""
        pd = [s for s in self.instances.serving(model) if s.info.role != "hybrid"]
        kinds = {s.info.dispatch for s in pd}
        if {"handoff", "trigger"} <= kinds:
            raise OpenAIError(
                503,
                f"The instances of `{model}` mix handoff-only and trigger-only P/D capability; the coordinator "
                "cannot pair them. Give every prefill and decode instance of a model the same connector kind.",
            )
        if self.config.pd_mode != PdMode.AUTO:
            return self.config.pd_mode
        if not pd:
            return PdMode.AGGREGATED
        if len(kinds) != 1:
            return PdMode.HANDOFF
        return _MODE_OF_DISPATCH.get(next(iter(kinds)), PdMode.HANDOFF)

    def _routable(self, model: str, role: str, adapter: str = "") -> list[InstanceState]:
        states = [s for s in self.instances.serving(model) if s.routable and s.info.role == role]
        if adapter and states:
            holds = self.placement
            if holds is None:
                return adapter_candidates(states, adapter)
            now = time.monotonic()
            states = adapter_candidates(
                states, adapter, holds.held_back(adapter, now), holds.resident_all(states, now)
            )
            failure = holds.last_failure(adapter, now)
            if not states and failure is not None:  # every instance failed to load it lately
                raise OpenAIError(
                    503 if failure.retryable else 500,
                    f"The adapter `{adapter}` could not be loaded on any instance of `{model}` lately "
                    f"({failure.message}); not retried there for {holds.failed_hold_s:g} s.",
                )
        return states

    def _candidates(
        self, states: Sequence[InstanceState], matches: dict[str, KvMatch] | None
    ) -> list[Candidate]:
        return candidates(states, self.ledger, matches, self.latency)

    async def _matches(
        self, policy: AsksFacts, request_id: str, request: OpenAIRequest, states
    ) -> tuple[dict | None, tuple[int, ...]]:
        """The conductor's facts, with predictions merged in, and the first prompt's chain hashes."""
        if not policy.needs_match:
            return None, ()
        ids = [s.info.instance_id for s in states]
        sizes = {s.info.block_size for s in states}
        block_size = sizes.pop() if len(sizes) == 1 else 0  # mixed block sizes: let the conductor hash
        # One lookup per request: the first prompt (multi-prompt completions are scored on it).
        prompt = request.prompts[0]
        adapter = request.adapter
        parent = adapter_root(adapter) if adapter else None  # an adapter's KV blocks are its own
        hashes = tuple(chain_hashes(prompt, block_size, parent=parent)) if block_size else ()
        matches = None
        if self.matcher is not None:
            with tracing.span("tandem.conductor_match", attributes={"tandem.candidates": len(ids)}):
                matches = await self.matcher.match(
                    request_id, request.model, prompt, ids, block_size, hashes, adapter=adapter
                )
        if self.predicted is not None and hashes and policy.uses_predictions:
            matches = self.predicted.overlay(hashes, matches, ids, block_size)
        return matches, hashes

    def _record(
        self,
        stage: str,
        policy: str,
        request_id: str,
        request: OpenAIRequest,
        cands: Sequence[Candidate],
        chosen: tuple[str, ...],
        predicted_ttft_s: float | None = None,
    ) -> None:
        """Keeps one scoring in the decision log (`decision_log.Decision`'s fields as a plain tuple): references
        only, nothing computed or formatted here."""
        entry = (
            time.time(), request_id, request.model, policy, stage, request.prompt_tokens, cands, chosen,
            predicted_ttft_s,
        )  # fmt: skip
        self.decisions.record(entry)

    async def _choose(
        self,
        policy: Policy,
        request_id: str,
        request: OpenAIRequest,
        states: Sequence[InstanceState],
        stage: str,
    ) -> tuple[Candidate, tuple[int, ...]]:
        """`policy`'s pick among `states` (the ledger's figures, and the conductor's facts when it asks), with the
        chain hashes the facts were asked with; kept in the decision log as `stage`."""
        matches, hashes = await self._matches(policy, request_id, request, states)
        facts = RequestFacts(
            request_id, request.model, request.prompt_tokens, request.max_tokens, hashes, request.adapter
        )
        cands = self._candidates(states, matches)
        metrics.decided(policy.name)
        if not tracing.ENABLED:
            chosen = policy.pick(facts, cands)
        else:
            with tracing.span("tandem.score", attributes={"tandem.policy": policy.name}) as current:
                chosen = policy.pick(facts, cands)
                if current is not None:
                    tracing.set_attributes(
                        current, candidate_attributes(cands, chosen, request.prompt_tokens)
                    )
        self._record(stage, policy.name, request_id, request, cands, (chosen.instance_id,))
        return chosen, hashes

    def _predict(self, policy: AsksFacts, leg: Leg, hashes: tuple[int, ...]) -> None:
        if self.predicted is not None and hashes and policy.uses_predictions:
            self.predicted.routed(leg.instance.info.instance_id, hashes)

    def _commit(
        self, state: InstanceState, prefill: int, decode: int, context: int, counted: int
    ) -> Commitment:
        # `counted`: what the leg adds to the engine's prompt-token counter when its prefill is done (vLLM counts
        # each prompt of each choice), so that the ledger can follow the engine's progress.
        return self.ledger.commit(state.info.instance_id, prefill, decode, context, counted)

    async def decide(
        self,
        api: str,
        raw_body: bytes,
        request_id: str,
        request: OpenAIRequest | None = None,
        allowed: frozenset[str] | None = None,
    ) -> Pick:
        """Chooses where the request goes and commits its workload; raises OpenAIError (400/404/503).
        `request` is the body already understood (off the event loop, for large bodies); `allowed`: the
        aggregated instances the admission queue predicts meet the request's SLO (the policy chooses among those
        still routable, or among all when none is)."""
        request = request or self.understand(api, raw_body)
        model, isl, out = request.model, request.prompt_tokens, request.max_tokens
        mode = self.mode_of(model)
        adapter = request.adapter
        if mode == PdMode.AGGREGATED:
            states = self._routable(model, "hybrid", adapter)
            if not states:
                raise OpenAIError(
                    503, f"No healthy instance serves {_named(request)} right now; retry later."
                )
            policy = self.policy
            pool = [s for s in states if s.info.instance_id in allowed] if allowed else states
            chosen, hashes = await self._choose(policy, request_id, request, pool or states, "aggregated")
            matched = min(chosen.match.matched_tokens, isl)
            leg = Leg(
                chosen.state,
                self._commit(chosen.state, isl - matched, out, isl + out, isl * request.n),
                chosen.match,
            )
            self._predict(policy, leg, hashes)
            fallback = self._fallback(states, chosen.state) if self.fallbacks else None
            picked = Pick(request, request_id, mode, leg, fallback=fallback)
            picked.predicted_ttft_s = prefill_s(chosen, isl)
            return picked
        if mode == PdMode.HANDOFF and len(request.prompts) > 1:
            raise OpenAIError(
                400, "P/D disaggregated serving takes one prompt per request; send them separately.", "prompt"
            )
        decodes = self._routable(model, "decode", adapter)
        if not decodes:
            raise OpenAIError(
                503, f"No healthy decode instance serves {_named(request)} right now; retry later."
            )
        if self.pair is not None:
            return await self._decide_pair(request, request_id, mode, decodes)
        policy = self.decode_policy
        decode, hashes = await self._choose(policy, request_id, request, decodes, "decode")
        leg = Leg(decode.state, self._commit(decode.state, 0, out, isl + out, isl * request.n), decode.match)
        self._predict(policy, leg, hashes)
        picked = Pick(request, request_id, mode, leg)
        picked.predicted_ttft_s = prefill_s(decode, isl)
        return picked

    async def _decide_pair(
        self, request: OpenAIRequest, request_id: str, mode: PdMode, decodes: list[InstanceState]
    ) -> Pick:
        """The joint choice: the prefill instance by the configured policy and the decode instance for it by
        predicted TTFT (the prefill leg is committed when it is sent), or under `adaptive` the decode instance alone,
        served as an aggregated request (no `kv_transfer_params`)."""
        assert self.pair is not None
        isl, out = request.prompt_tokens, request.max_tokens
        prefills = self._routable(request.model, "prefill", request.adapter)
        matches, hashes = await self._matches(self.pair, request_id, request, [*prefills, *decodes])
        p_cands, d_cands = self._candidates(prefills, matches), self._candidates(decodes, matches)
        facts = RequestFacts(request_id, request.model, isl, out, hashes, request.adapter)
        with tracing.span("tandem.score", attributes={"tandem.policy": "pd_joint"}) as current:
            # The prefill instance is the configured policy's pick; the decode instance is chosen for it.
            choice = self.pair.choose(
                isl, p_cands, d_cands, prefill_pick=lambda cands: self.policy.pick(facts, cands)
            )
            if current is not None:
                attributes = candidate_attributes(p_cands, choice.prefill, isl)
                attributes.update(candidate_attributes(d_cands, choice.decode, isl))
                attributes["tandem.predicted_ttft_s"] = choice.ttft_s
                tracing.set_attributes(current, attributes)
        chosen = (c.instance_id for c in (choice.prefill, choice.decode) if c is not None)
        self._record(
            "pair", "pd_joint", request_id, request, [*p_cands, *d_cands], tuple(chosen), choice.ttft_s
        )
        d = choice.decode
        if choice.prefill is None:
            matched = min(d.match.matched_tokens, isl)
            leg = Leg(d.state, self._commit(d.state, isl - matched, out, isl + out, isl * request.n), d.match)
            self._predict(self.pair, leg, hashes)
            picked = Pick(request, request_id, PdMode.AGGREGATED, leg, matches, hashes, planned=choice)
            picked.predicted_ttft_s = choice.ttft_s
            return picked
        leg = Leg(d.state, self._commit(d.state, 0, out, isl + out, isl * request.n), d.match)
        self._predict(self.pair, leg, hashes)
        picked = Pick(request, request_id, mode, leg, matches or {}, hashes, planned=choice)
        picked.predicted_ttft_s = choice.ttft_s
        return picked

    def _pair_prefill(self, pick: Pick, states: list[InstanceState]) -> Candidate:
        """The prefill instance of a joint pick: in handoff mode the planned one on the first attempt (still
        routable; its leg goes out as soon as it was planned), else the best one for the decode instance already
        chosen, on the ledger as it is now. A trigger callback comes after the decode engine allocated, and a plan
        made at arrival does not count the prefill legs sent meanwhile: a burst would all go to the instance it
        planned (docs/pd.md, "The simulator against the real-time mesh")."""
        assert self.pair is not None
        planned = pick.planned.prefill if pick.planned is not None else None
        ids = {s.info.instance_id for s in states}
        cands = self._candidates(states, pick.matches)
        chosen: Candidate | None
        if planned is not None and planned.instance_id in ids and pick.mode is PdMode.HANDOFF:
            chosen = next(c for c in cands if c.instance_id == planned.instance_id)
            choice = pick.planned
        else:
            (decode,) = self._candidates([pick.target.instance], pick.matches)
            choice = self.pair.prefill_for(pick.request.prompt_tokens, cands, decode)
            chosen = choice.prefill
            pick.planned = choice
        assert choice is not None and chosen is not None
        self.pair.sent(choice)
        return chosen

    def _fallback(self, states: list[InstanceState], chosen: InstanceState) -> str | None:
        """The least-loaded other engine of the pick's pool: where Envoy retries if the pick refuses the request
        before any byte (it died or hung since its last heartbeat). Its workload is not committed: a retry is rare,
        and the access log's entry releases the request's ticket wherever it ran."""
        others = [s for s in states if s is not chosen]
        if not others:
            return None
        ledger = self.ledger
        return min(others, key=lambda s: (ledger.tokens(s.info.instance_id), s.info.instance_id)).info.address

    async def pick_prefill(self, pick: Pick, exclude: set[str]) -> Leg:
        """A prefill instance for the next attempt, not one of `exclude`; 503 when none is left."""
        request = pick.request
        prefills = self._routable(request.model, "prefill", request.adapter)
        states = [s for s in prefills if s.info.instance_id not in exclude]
        if not states:
            tried = f" ({len(exclude)} tried)" if exclude else ""
            raise OpenAIError(503, f"No healthy prefill instance serves `{request.model}` right now{tried}.")
        policy: AsksFacts = self.policy
        if pick.matches is None:
            matches, pick.hashes = await self._matches(policy, pick.request_id, request, prefills)
            pick.matches = matches or {}
        if self.pair is not None:
            policy = self.pair
            chosen = self._pair_prefill(pick, states)
        else:
            cands = self._candidates(states, pick.matches)
            with tracing.span("tandem.score", attributes={"tandem.policy": self.policy.name}) as current:
                chosen = self.policy.pick(pick.facts, cands)
                if current is not None:
                    attributes = candidate_attributes(cands, chosen, request.prompt_tokens)
                    tracing.set_attributes(current, attributes)
            self._record("prefill", self.policy.name, pick.request_id, request, cands, (chosen.instance_id,))
        isl = request.prompt_tokens
        matched = min(chosen.match.matched_tokens, isl)
        leg = Leg(chosen.state, self._commit(chosen.state, isl - matched, 0, isl, isl), chosen.match)
        self._predict(policy, leg, pick.hashes)
        return leg

    def kv_moved(self, pick: Pick, prefill: Leg) -> tuple[int, bool]:
        """The KV bytes a P/D pair moves (predicted: the prompt tokens the decode instance was not known to hold,
        `kv_bytes_per_token` each) and whether they cross nodes, for the prefill leg `prefill` of `pick`; the same
        figure under every `pd_choice`, so that the choices compare."""
        isl = pick.request.prompt_tokens
        tokens = max(0, isl - min(pick.target.match.matched_tokens, isl))
        cross = self.topology.cross_node(prefill.instance.info.node_id, pick.target.instance.info.node_id)
        return tokens * self.kv_bytes_per_token, cross

    def release(self, leg: Leg) -> bool:
        """Releases one leg's workload; True the first time only."""
        return self.ledger.release(leg.commitment)
