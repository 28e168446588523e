"""The scheduling plug-in interface: a policy picks one candidate for a request, and each policy module declares
itself once (`PolicyType`). Nothing else lives here (the conductor's facts a candidate carries, `KvMatch`, sit
below it in `coordinator.kv_facts`, where the predicted cache reads them too).

The framework (`coordinator.picker`) filters candidates (healthy, not drained, serving the model, right role),
asks the conductor for KV facts when the policy `needs_match`, and calls `pick`. Policies are pure: same inputs,
same choice (randomness, where a policy has any, comes from its own seeded generator).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from coordinator.instances import InstanceState
from coordinator.kv_facts import NO_MATCH, KvMatch
from coordinator.latency import StepCosts


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What a policy may know about the request being placed."""

    request_id: str
    model: str
    isl: int  # input sequence length over all prompts of the request
    max_tokens: int  # output tokens requested (per prompt times n), as counted for workload
    #: Chain hashes (`tandem.chain_hash`) of the first prompt's full blocks at the candidates' block size, when the
    #: policy `needs_match` and the candidates share one block size; empty otherwise.
    prompt_hashes: Sequence[int] = ()
    #: The LoRA adapter the request names (its `model` when that is an adapter of the base model); "" for the
    #: base model. `prompt_hashes` are then chained from the adapter (`tandem.chain_hash.adapter_root`).
    adapter: str = ""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A routable instance with the coordinator's workload figures and the conductor's KV facts for it."""

    state: InstanceState
    prefill_tokens: int  # prompt tokens committed to prefill on it and not yet computed (ISL - matched)
    decode_tokens: int  # output tokens committed to decode on it by requests in flight
    inflight: int  # requests in flight on it through this coordinator
    context_tokens: int = 0  # prompt plus output tokens of its requests in flight (KV footprint)
    match: KvMatch = NO_MATCH  # NO_MATCH when the policy asks for none or the conductor gave no answer
    costs: StepCosts | None = None  # its learned step costs (`coordinator.latency`); None when not known

    @property
    def instance_id(self) -> str:
        """Shortcut to the instance id."""
        return self.state.info.instance_id

    @property
    def load_tokens(self) -> int:
        """Committed tokens of work in flight: prefill plus decode."""
        return self.prefill_tokens + self.decode_tokens


class Policy(Protocol):
    """A scheduling policy. `pick` is called with at least one candidate and returns one of them."""

    name: str
    needs_match: bool  # True when `pick` reads `Candidate.match` (the conductor is asked first)
    #: True when `Candidate.match` should include the coordinator's predicted cache (prompts just routed count as
    #: cached until KV events confirm them, `coordinator.predicted_cache`); peers that do not predict say False.
    uses_predictions: bool

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        """The candidate to serve `request`."""
        ...


#: Builds a policy from its raw parameters (a config mapping, None for the defaults); ValueError naming the bad key.
Factory = Callable[[Mapping[str, Any] | None], Policy]


@dataclass(frozen=True, slots=True)
class PolicyType:
    """The one registration of a policy type, declared by its module (`POLICY`) and listed by the registry: the
    config learns from it which `scheduler` sections exist and what their parameters are."""

    name: str  # the type name configs use (`scheduler.policy`, `scheduler.decode_policy`, `policies[].type`)
    params: type  # its frozen parameter dataclass, whose defaults fill the effective config
    create: Factory  # a new policy of this type from raw parameters
    #: The `scheduler` section that holds its parameters (`scheduler.<section>.<key>`); None for a type that takes
    #: none (a section for it would be an unknown key).
    section: str | None = None
