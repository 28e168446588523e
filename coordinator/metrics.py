"""Prometheus metrics of the coordinator."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from coordinator.workload import WorkloadLedger

ROUTED = Counter("tandem_coordinator_routed_requests", "Requests routed to an engine", ["instance"])
REJECTED = Counter("tandem_coordinator_rejected_requests", "Requests answered with an error", ["status"])
INFLIGHT = Gauge("tandem_coordinator_inflight_requests", "Requests in flight")
WORKLOAD = Gauge("tandem_coordinator_workload_tokens", "Tokens committed to an instance", ["instance"])
DECISION_SECONDS = Histogram(
    "tandem_coordinator_decision_seconds",
    "Time to validate, tokenize and schedule one request",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
)
INSTANCES = Gauge("tandem_coordinator_instances", "Registered instances by health", ["health"])


def set_workload(ledger: WorkloadLedger, instance_id: str) -> None:
    """Publishes the ledger's figure for one instance."""
    WORKLOAD.labels(instance_id).set(ledger.tokens(instance_id))


MATCH_FALLBACKS = Counter(
    "tandem_coordinator_match_fallbacks",
    "Requests scored on load alone because the conductor could not answer",
    ["reason"],
)
PREFILL_LEGS = Counter("tandem_coordinator_prefill_legs", "Prefill legs sent in P/D handoff", ["outcome"])
CALLBACKS = Counter("tandem_coordinator_metaserver_callbacks", "Metaserver callbacks by outcome", ["outcome"])
