"""The scheduling plug-in interface: a policy picks one candidate for a request. Nothing else lives here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from coordinator.instances import InstanceState


@dataclass(frozen=True, slots=True)
class RequestFacts:
    """What a policy may know about the request being placed."""

    request_id: str
    model: str
    prompt_tokens: int  # input sequence length over all prompts of the request
    max_tokens: int  # output tokens requested (per prompt times n), as counted for workload


@dataclass(frozen=True, slots=True)
class Candidate:
    """A routable instance with the coordinator's workload figures for it."""

    state: InstanceState
    workload_tokens: int  # tokens committed by this coordinator's requests in flight
    inflight: int  # requests in flight through this coordinator

    @property
    def instance_id(self) -> str:
        """Shortcut to the instance id."""
        return self.state.info.instance_id


class Policy(Protocol):
    """A scheduling policy. `pick` is called with at least one candidate and returns one of them."""

    name: str

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        """The candidate to serve `request`."""
        ...
