"""`round_robin`: candidates in turn, per model."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.scheduling.interface import Candidate, RequestFacts

TYPE = "round_robin"


class RoundRobin:
    """Cycles through the candidates of each model, in instance-id order."""

    name = TYPE

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        """The next candidate after the last one picked for this model."""
        ordered = sorted(candidates, key=lambda c: c.instance_id)
        turn = self._next.get(request.model, 0)
        self._next[request.model] = turn + 1
        return ordered[turn % len(ordered)]


def create() -> RoundRobin:
    """Factory used by the policy registry; `round_robin` takes no parameters."""
    return RoundRobin()
