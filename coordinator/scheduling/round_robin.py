"""`round_robin`: candidates in turn, per model. No parameters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.scheduling.interface import Candidate, PolicyType, RequestFacts
from coordinator.scheduling.params import parse_params

TYPE = "round_robin"


@dataclass(frozen=True, slots=True)
class Params:
    """`round_robin` takes no parameters."""


class RoundRobin:
    """Cycles through the candidates of each model, in instance-id order."""

    name = TYPE
    needs_match = False
    uses_predictions = False

    def __init__(self, params: Params = Params()) -> None:
        self.params = params
        self._next: dict[str, int] = {}

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        """The next candidate after the last one picked for this model."""
        ordered = sorted(candidates, key=lambda c: c.instance_id)
        turn = self._next.get(request.model, 0)
        self._next[request.model] = turn + 1
        return ordered[turn % len(ordered)]


def create(raw: Mapping[str, Any] | None = None) -> RoundRobin:
    """Factory used by the policy registry."""
    return RoundRobin(parse_params(Params, raw, TYPE))


POLICY = PolicyType(TYPE, Params, create)
