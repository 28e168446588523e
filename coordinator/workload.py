"""Workload accounting in tokens per instance: every commit is released exactly once (pure core)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Commitment:
    """Tokens committed to one instance by one request; `released` guards against double release."""

    instance_id: str
    tokens: int
    released: bool = False


class WorkloadLedger:
    """Tokens and requests in flight per instance. Counters return to zero when every commitment is released."""

    def __init__(self) -> None:
        self._tokens: dict[str, int] = {}
        self._requests: dict[str, int] = {}

    def commit(self, instance_id: str, tokens: int) -> Commitment:
        """Adds `tokens` (>= 0) and one request to `instance_id`."""
        if tokens < 0:
            raise ValueError(f"cannot commit {tokens} tokens")
        self._tokens[instance_id] = self._tokens.get(instance_id, 0) + tokens
        self._requests[instance_id] = self._requests.get(instance_id, 0) + 1
        return Commitment(instance_id, tokens)

    def release(self, commitment: Commitment) -> bool:
        """Takes a commitment back; returns False (and changes nothing) when it was already released."""
        if commitment.released:
            return False
        commitment.released = True
        iid = commitment.instance_id
        tokens = self._tokens[iid] - commitment.tokens
        requests = self._requests[iid] - 1
        if requests == 0:
            # Drop idle entries so that the ledger does not grow with every instance ever seen.
            del self._tokens[iid], self._requests[iid]
        else:
            self._tokens[iid], self._requests[iid] = tokens, requests
        return True

    def tokens(self, instance_id: str) -> int:
        """Tokens in flight on `instance_id`."""
        return self._tokens.get(instance_id, 0)

    def requests(self, instance_id: str) -> int:
        """Requests in flight on `instance_id`."""
        return self._requests.get(instance_id, 0)

    @property
    def total_tokens(self) -> int:
        """Tokens in flight over all instances."""
        return sum(self._tokens.values())

    @property
    def total_requests(self) -> int:
        """Requests in flight over all instances."""
        return sum(self._requests.values())
