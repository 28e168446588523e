"""The endpoint picker: from a request body to the instance that serves it, with its workload committed.

Pure core: the ext_proc shell feeds it bytes and turns its decisions (or `OpenAIError`s) into Envoy replies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from coordinator.config import CoordinatorConfig
from coordinator.errors import OpenAIError
from coordinator.instances import InstanceState, InstanceTable
from coordinator.openai_request import OpenAIRequest, model_of, parse_body, understand
from coordinator.scheduling import Candidate, Policy, RequestFacts
from coordinator.workload import Commitment, WorkloadLedger
from tandem.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Decision:
    """Where a request goes, and the workload it holds until it ends."""

    request: OpenAIRequest
    instance: InstanceState
    commitment: Commitment


class TokenizerCache:
    """One tokenizer per model, loaded on first use."""

    def __init__(self, paths: dict[str, str | None], load) -> None:
        self._paths = paths
        self._load = load
        self._by_model: dict[str, Tokenizer] = {}

    def get(self, model: str) -> Tokenizer:
        """The tokenizer of `model` (the built-in one when the config names none)."""
        tok = self._by_model.get(model)
        if tok is None:
            tok = self._by_model[model] = self._load(self._paths.get(model))
        return tok


class EndpointPicker:
    """Validates, tokenizes, schedules and commits workload for one request at a time."""

    def __init__(
        self,
        config: CoordinatorConfig,
        instances: InstanceTable,
        ledger: WorkloadLedger,
        policy: Policy,
        tokenizers: TokenizerCache,
    ) -> None:
        self.config = config
        self.instances = instances
        self.ledger = ledger
        self.policy = policy
        self.tokenizers = tokenizers

    def decide(self, api: str, raw_body: bytes, request_id: str) -> Decision:
        """Picks an instance and commits the request's tokens to it; raises OpenAIError (400/404/503)."""
        body = parse_body(raw_body)
        model = model_of(body)
        if model not in self.instances.known_models:
            served = ", ".join(sorted(self.instances.known_models)) or "none"
            raise OpenAIError(404, f"The model `{model}` does not exist. Models served: {served}.", "model")
        default_max = self.config.chat_default_max_tokens if api == "chat.completions" else self.config.default_max_tokens
        request = understand(api, body, self.tokenizers.get(model), default_max)
        candidates = [
            Candidate(s, self.ledger.tokens(s.info.instance_id), self.ledger.requests(s.info.instance_id))
            for s in self.instances.serving(model)
            if s.routable
        ]
        if not candidates:
            raise OpenAIError(503, f"No healthy instance serves the model `{model}` right now; retry later.")
        facts = RequestFacts(request_id, model, request.prompt_tokens, request.max_tokens)
        chosen = self.policy.pick(facts, candidates)
        commitment = self.ledger.commit(chosen.instance_id, request.prompt_tokens + request.max_tokens)
        return Decision(request, chosen.state, commitment)

    def finish(self, decision: Decision) -> bool:
        """Releases the request's workload; True the first time only."""
        return self.ledger.release(decision.commitment)
