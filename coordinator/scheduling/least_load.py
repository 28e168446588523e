"""`least_load`: the candidate with the fewest tokens of work in flight. No parameters.

Load is counted in tokens, as the coordinator committed them (prompt tokens still to prefill plus output tokens to
decode, for every request in flight), because a request count treats a 30k-token prompt like a 10-token one. Ties
go to the candidate with fewer requests in flight, then fewer requests the engine itself reports (running plus
waiting, from heartbeats, which include traffic that did not pass through this coordinator), then in turn, so that
an idle fleet is used evenly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.scheduling.interface import Candidate, PolicyType, RequestFacts
from coordinator.scheduling.params import parse_params

TYPE = "least_load"


@dataclass(frozen=True, slots=True)
class Params:
    """`least_load` takes no parameters."""


def load_key(c: Candidate) -> tuple[int, int, int]:
    """Committed tokens, then in-flight requests, then engine-reported requests."""
    return (c.load_tokens, c.inflight, c.state.load.running + c.state.load.waiting)


class Rotation:
    """Picks among tied candidates in turn, so that ties spread evenly and deterministically."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, tied: list[Candidate]) -> Candidate:
        if len(tied) == 1:
            return tied[0]
        self._turn += 1
        return sorted(tied, key=lambda c: c.instance_id)[self._turn % len(tied)]


class LeastLoad:
    """Fewest committed tokens; ties broken by in-flight requests, engine-reported requests, then rotation."""

    name = TYPE
    needs_match = False
    uses_predictions = False

    def __init__(self, params: Params = Params()) -> None:
        self.params = params
        self._rotation = Rotation()

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        """The least-loaded candidate."""
        best = min(load_key(c) for c in candidates)
        return self._rotation.choose([c for c in candidates if load_key(c) == best])


def create(raw: Mapping[str, Any] | None = None) -> LeastLoad:
    """Factory used by the policy registry."""
    return LeastLoad(parse_params(Params, raw, TYPE))


POLICY = PolicyType(TYPE, Params, create)
