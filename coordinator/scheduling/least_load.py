"""`least_load`: the candidate with the fewest tokens in flight.

Load is counted in tokens, as the coordinator committed them (prompt tokens plus requested output tokens of
every request in flight), because a request count treats a 30k-token prompt like a 10-token one. Ties go to
the candidate with fewer requests in flight, then fewer requests the engine itself reports (running plus
waiting, from heartbeats, which include traffic that did not pass through this coordinator), then in turn, so
that an idle fleet is used evenly.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.scheduling.interface import Candidate, RequestFacts

TYPE = "least_load"


class LeastLoad:
    """Fewest committed tokens; ties broken by in-flight requests, engine-reported requests, then rotation."""

    name = TYPE

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, request: RequestFacts, candidates: Sequence[Candidate]) -> Candidate:
        """The least-loaded candidate."""

        def key(c: Candidate) -> tuple[int, int, int]:
            load = c.state.load
            return (c.workload_tokens, c.inflight, load.running + load.waiting)

        best = min(key(c) for c in candidates)
        tied = sorted((c for c in candidates if key(c) == best), key=lambda c: c.instance_id)
        self._turn += 1
        return tied[self._turn % len(tied)]


def create() -> LeastLoad:
    """Factory used by the policy registry; `least_load` takes no parameters."""
    return LeastLoad()
