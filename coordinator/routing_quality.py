"""Routing-quality SLIs (docs/operations.md, "Routing quality"): what the coordinator expected of its choice, and
what happened.

At the decision (`Decider`) a routed request's `Prediction` is kept on its ticket: the prompt tokens the
coordinator expected cached on the chosen instance, per cache tier (the conductor's facts with the predicted cache
merged in), and the chosen instance's predicted time to first token (`Pick.predicted_ttft_s`, from `pd_joint.prefill_s`). When Envoy's
access log reports the request's end (`access_log.py`, after the response, off its path), a streamed request's
actual TTFT is what Envoy timed from sending the request to the engine to the engine's first byte (a streamed
answer's first event carries the first token). Both sides go to Prometheus histograms per model and instance.

Pure: `prediction_of` and `actual_ttft_s` decide; `metrics.routing_quality` observes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from coordinator.kv_facts import KvMatch

TIERS = ("npu", "cpu", "disk")


@dataclass(slots=True, frozen=True)
class Prediction:
    """What the coordinator expected of one routed request's instance."""

    model: str
    instance_id: str
    hit_tokens: tuple[
        int, int, int
    ]  # expected cached prompt tokens per tier (npu, cpu, disk), capped at the ISL
    prompt_tokens: int
    ttft_s: float  # predicted time to first token on the instance
    streamed: bool  # only a streamed answer's first byte is its first token
    tier: str = "default"  # the service tier it was served in (`coordinator.tenants`)


def prediction_of(
    model: str,
    instance_id: str,
    match: KvMatch,
    prompt_tokens: int,
    ttft_s: float,
    streamed: bool,
    tier: str = "default",
) -> Prediction:
    """The prediction for a request of `prompt_tokens` sent to `instance_id`, chosen on `match`."""
    left = prompt_tokens
    hits = []
    for blocks in (match.npu_blocks, match.cpu_blocks, match.disk_blocks):
        tokens = min(left, blocks * match.block_size)
        hits.append(tokens)
        left -= tokens
    return Prediction(model, instance_id, (hits[0], hits[1], hits[2]), prompt_tokens, ttft_s, streamed, tier)


def actual_ttft_s(first_upstream_tx_s: float, first_upstream_rx_s: float) -> float | None:
    """The engine's time to first byte as Envoy timed it (both offsets from the request's start; 0: not reached);
    None when the request never reached the engine or got nothing back."""
    if first_upstream_tx_s <= 0 or first_upstream_rx_s <= 0 or first_upstream_rx_s < first_upstream_tx_s:
        return None
    return first_upstream_rx_s - first_upstream_tx_s


class TtftAttainment:
    """Per service tier, streamed requests measured and those whose first token came within the tier's TTFT
    objective (`Admin/GetStats` `ttft_slo`, `tandem top`)."""

    def __init__(self, slo_s: Mapping[str, float]) -> None:
        self.slo_s = dict(slo_s)  # tier -> objective, seconds
        self.counts: dict[str, list[int]] = {}  # tier -> [measured, within the objective]

    def observe(self, tier: str, actual_s: float) -> None:
        counts = self.counts.get(tier)
        if counts is None:
            counts = self.counts[tier] = [0, 0]
        counts[0] += 1
        slo = self.slo_s.get(tier)
        if slo is None or actual_s <= slo:
            counts[1] += 1


class DeliveredHits:
    """The hits engines report: per instance, the last cumulative `vllm:prefix_cache_hits_total` of each rank
    (carried in heartbeats); `delta` turns each new sample into the tokens found cached since the previous one.
    Compared, as rates, with the predicted hits of the requests routed there
    (`tandem_coordinator_{predicted,delivered}_hit_tokens_total`): read from the engine's own counters, so nothing
    runs on the response path."""

    def __init__(self) -> None:
        self._last: dict[str, dict[int, int]] = {}

    def delta(self, instance_id: str, hits: Mapping[int, int]) -> int:
        """Tokens found cached on `instance_id` since its previous sample (0 for the first: the baseline). A counter
        that went back (the engine restarted) counts from zero."""
        last = self._last.get(instance_id)
        self._last[instance_id] = dict(hits)
        if last is None:
            return 0
        total = 0
        for rank, value in hits.items():
            before = last.get(rank, 0)
            total += value - before if value >= before else value
        return total

    def forget(self, instance_id: str) -> None:
        self._last.pop(instance_id, None)
