"""Workload accounting in tokens per instance: every commit is released exactly once (pure core).

A request commits, on each instance it uses, the tokens of work it brings there:
- prefill tokens: prompt tokens the instance must compute, `ISL - matched_tokens` (cached prefix excluded);
- decode tokens: output tokens the instance will generate (`max_tokens` per prompt and choice);
- context tokens: prompt plus output tokens the instance holds KV for while the request runs (its KV footprint).
An aggregated request commits both on one instance; in P/D handoff the prefill leg commits prefill tokens on the
prefill instance (released when the leg ends) and the decode leg commits decode tokens on the decode instance.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Commitment:
    """Tokens committed to one instance by one request leg; `released` guards against double release."""

    instance_id: str
    prefill_tokens: int
    decode_tokens: int
    context_tokens: int = 0
    released: bool = False


class WorkloadLedger:
    """Tokens and requests in flight per instance. Counters return to zero when every commitment is released."""

    def __init__(self) -> None:
        self._prefill: dict[str, int] = {}
        self._decode: dict[str, int] = {}
        self._context: dict[str, int] = {}
        self._requests: dict[str, int] = {}

    def commit(
        self, instance_id: str, prefill_tokens: int, decode_tokens: int, context_tokens: int = 0
    ) -> Commitment:
        """Adds the tokens (each >= 0) and one request to `instance_id`."""
        if min(prefill_tokens, decode_tokens, context_tokens) < 0:
            raise ValueError(
                f"cannot commit negative tokens ({prefill_tokens}, {decode_tokens}, {context_tokens})"
            )
        self._prefill[instance_id] = self._prefill.get(instance_id, 0) + prefill_tokens
        self._decode[instance_id] = self._decode.get(instance_id, 0) + decode_tokens
        self._context[instance_id] = self._context.get(instance_id, 0) + context_tokens
        self._requests[instance_id] = self._requests.get(instance_id, 0) + 1
        return Commitment(instance_id, prefill_tokens, decode_tokens, context_tokens)

    def release(self, commitment: Commitment) -> bool:
        """Takes a commitment back; returns False (and changes nothing) when it was already released."""
        if commitment.released:
            return False
        commitment.released = True
        iid = commitment.instance_id
        requests = self._requests[iid] - 1
        if requests == 0:
            # Drop idle entries so that the ledger does not grow with every instance ever seen.
            del self._prefill[iid], self._decode[iid], self._context[iid], self._requests[iid]
        else:
            self._requests[iid] = requests
            self._prefill[iid] -= commitment.prefill_tokens
            self._decode[iid] -= commitment.decode_tokens
            self._context[iid] -= commitment.context_tokens
        return True

    def prefill_tokens(self, instance_id: str) -> int:
        """Prefill tokens in flight on `instance_id`."""
        return self._prefill.get(instance_id, 0)

    def decode_tokens(self, instance_id: str) -> int:
        """Decode tokens in flight on `instance_id`."""
        return self._decode.get(instance_id, 0)

    def context_tokens(self, instance_id: str) -> int:
        """Context (KV footprint) tokens in flight on `instance_id`."""
        return self._context.get(instance_id, 0)

    def tokens(self, instance_id: str) -> int:
        """All tokens in flight on `instance_id`."""
        return self._prefill.get(instance_id, 0) + self._decode.get(instance_id, 0)

    def requests(self, instance_id: str) -> int:
        """Request legs in flight on `instance_id`."""
        return self._requests.get(instance_id, 0)

    @property
    def total_tokens(self) -> int:
        """Tokens in flight over all instances."""
        return sum(self._prefill.values()) + sum(self._decode.values())

    @property
    def total_requests(self) -> int:
        """Request legs in flight over all instances."""
        return sum(self._requests.values())
