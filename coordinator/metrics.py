"""Prometheus metrics of the coordinator. Per-request updates are kept cheap: label children are cached, and the
workload figures are read from the ledger at scrape time."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from coordinator.capacity import Sizing
from coordinator.latency import LatencyBook
from coordinator.scheduling.pd_joint import PairChoice
from coordinator.workload import WorkloadLedger

ROUTED = Counter("tandem_coordinator_routed_requests", "Requests routed to an engine", ["instance"])
REJECTED = Counter("tandem_coordinator_rejected_requests", "Requests answered with an error", ["status"])
INFLIGHT = Gauge("tandem_coordinator_inflight_requests", "Requests in flight")
DECISION_SECONDS = Histogram(
    "tandem_coordinator_decision_seconds",
    "Time to validate, tokenize and schedule one request",
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05),
)
DECISIONS = Counter(
    "tandem_coordinator_decisions",
    "Instances chosen, by the policy that chose them (scheduler.policy, and decode_policy for P/D decode "
    "instances); a P/D request counts one per leg",
    ["policy"],
)
INSTANCES = Gauge("tandem_coordinator_instances", "Registered instances by health", ["health"])
REGISTRATIONS_REFUSED = Counter(
    "tandem_coordinator_registrations_refused",
    "Instance registrations refused (foreign id or host, over the per-node cap, Envoy's own address)",
    ["code"],
)
INSTANCES_REMOVED = Counter(
    "tandem_coordinator_silent_instances_removed",
    "Instances removed from the registry because their agent stayed silent (coordinator.instance_removal_s)",
)
MATCH_FALLBACKS = Counter(
    "tandem_coordinator_match_fallbacks",
    "Requests scored on load alone because the conductor could not answer",
    ["reason"],
)
ADAPTER_LOADS = Counter(
    "tandem_coordinator_adapter_loads",
    "LoRA adapter loads the coordinator asked a node agent for (NodeAgent.LoadAdapter), by outcome (ok, failed, "
    "unavailable)",
    ["outcome"],
)
ADAPTER_UNLOADS = Counter(
    "tandem_coordinator_adapter_unloads",
    "LoRA adapters the coordinator unloaded (NodeAgent.UnloadAdapter) to keep an engine within its max_loras: the "
    "least recently used with no request in flight, by outcome (ok, failed)",
    ["outcome"],
)
PREFILL_LEGS = Counter("tandem_coordinator_prefill_legs", "Prefill legs sent by the coordinator", ["outcome"])
CALLBACK_PATH_SECONDS = Histogram(
    "tandem_coordinator_trigger_callback_path_seconds",
    "Trigger mode: from the decode request leaving the coordinator to its prefill leg going out (the decode "
    "engine's allocation and metaserver callback through Envoy)",
    buckets=(
        0.0005,
        0.001,
        0.0015,
        0.002,
        0.003,
        0.004,
        0.005,
        0.0075,
        0.01,
        0.015,
        0.02,
        0.03,
        0.05,
        0.1,
        0.25,
        1,
    ),
)
ALS_STREAMS = Gauge(
    "tandem_coordinator_access_log_streams", "Envoy access log streams connected (0: request ends go unseen)"
)
PD_CHOICES = Counter(
    "tandem_coordinator_pd_choices",
    "Joint P/D choices (scheduler.pd_choice joint or adaptive): disaggregated, or served by a decode instance alone",
    ["model", "choice"],
)
KV_TRANSFER_BYTES = Counter(
    "tandem_coordinator_kv_transfer_bytes",
    "KV bytes P/D pairs moved between instances, counted per completed prefill leg under every pd_choice "
    "(predicted: prompt tokens the decode instance was not known to hold times the model's KV bytes per token), "
    "inside a node or across nodes",
    ["scope"],
)
CALLBACKS = Counter("tandem_coordinator_metaserver_callbacks", "Metaserver callbacks by outcome", ["outcome"])
QUEUE_DEPTH = Gauge(
    "tandem_coordinator_queue_depth",
    "Requests waiting in the coordinator's admission queue (coordinator.flow_control), by tier",
    ["tier"],
)
QUEUE_WAIT_SECONDS = Histogram(
    "tandem_coordinator_queue_wait_seconds",
    "Time a request waited in the admission queue until it was released, refused, or its client left",
    ["tier", "tenant"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60),
)
SHED = Counter(
    "tandem_coordinator_shed",
    "Requests the admission queue answered 429 `rejected: saturated`, by reason (saturated: the queue was full; "
    "expired: past the tier's queue TTL; displaced: a higher tier took its place; late: its predicted wait and "
    "the tier's TTFT threshold exceeded its TTFT SLO)",
    ["tier", "tenant", "reason"],
)


class WorkloadCollector:
    """Committed tokens per instance and bucket, read from the ledger at scrape time."""

    def __init__(self) -> None:
        self.ledger: WorkloadLedger | None = None
        self.instance_ids: Callable[[], list[str]] = list

    def watch(self, ledger: WorkloadLedger, instance_ids: Callable[[], list[str]]) -> None:
        """Reports this ledger from now on."""
        self.ledger, self.instance_ids = ledger, instance_ids

    def collect(self):
        family = GaugeMetricFamily(
            "tandem_coordinator_workload_tokens",
            "Tokens committed to an instance",
            labels=["instance", "bucket"],
        )
        if self.ledger is not None:
            for iid in self.instance_ids():
                family.add_metric([iid, "prefill"], self.ledger.prefill_tokens(iid))
                family.add_metric([iid, "decode"], self.ledger.decode_tokens(iid))
        yield family


WORKLOAD = WorkloadCollector()
REGISTRY.register(WORKLOAD)


class LatencyCollector:
    """Each instance's learned step costs (`coordinator.latency`), read at scrape time."""

    def __init__(self) -> None:
        self.book: LatencyBook | None = None
        self.instance_ids: Callable[[], list[str]] = list

    def watch(self, book: LatencyBook, instance_ids: Callable[[], list[str]]) -> None:
        """Reports this book from now on."""
        self.book, self.instance_ids = book, instance_ids

    def collect(self):
        family = GaugeMetricFamily(
            "tandem_coordinator_step_cost_seconds",
            "Learned engine step costs: per step, per prompt token computed, per decoding sequence and per context "
            "token a decoding sequence reads",
            labels=["instance", "term"],
        )
        if self.book is not None:
            for iid in self.instance_ids():
                costs = self.book.costs(iid)
                for term in ("step", "prefill", "decode", "context"):
                    family.add_metric([iid, term], getattr(costs, term))
        yield family


LATENCY = LatencyCollector()
REGISTRY.register(LATENCY)


class SizingCollector:
    """Each model's P:D sizing signal (`coordinator.capacity`), computed at scrape time."""

    def __init__(self) -> None:
        self.sizing: Callable[[], list[Sizing]] = list

    def watch(self, sizing: Callable[[], list[Sizing]]) -> None:
        """Reports these figures from now on."""
        self.sizing = sizing

    def collect(self):
        used = GaugeMetricFamily(
            "tandem_coordinator_pd_utilisation",
            "Demand over learned capacity per model and role (prefill, decode; hybrid for an aggregated pool): "
            "0 idle, 1 saturated, above 1 overloaded",
            labels=["model", "role"],
        )
        suggested = GaugeMetricFamily(
            "tandem_coordinator_pd_suggested_instances",
            "Of a P/D model's prefill and decode instances, the split that minimises the larger utilisation",
            labels=["model", "role"],
        )
        for z in self.sizing():
            if z.aggregated:
                used.add_metric([z.model, "hybrid"], z.utilisation)
                continue
            used.add_metric([z.model, "prefill"], z.prefill_utilisation)
            used.add_metric([z.model, "decode"], z.decode_utilisation)
            suggested.add_metric([z.model, "prefill"], z.suggested_prefill)
            suggested.add_metric([z.model, "decode"], z.suggested_decode)
        yield used
        yield suggested


SIZING = SizingCollector()
REGISTRY.register(SIZING)


class TicketCollector:
    """Tickets outstanding and ended by reason, read from the ticket table at scrape time."""

    def __init__(self) -> None:
        self.table = None

    def watch(self, table) -> None:
        self.table = table
        INFLIGHT.set_function(lambda: len(table))

    def collect(self):
        ended = CounterMetricFamily(
            "tandem_coordinator_tickets_ended",
            "Routed requests whose holdings were released, by why (completed, failed, client_gone, aborted, "
            "expired, reconciled)",
            labels=["reason"],
        )
        unknown = CounterMetricFamily(
            "tandem_coordinator_access_log_unknown_tickets",
            "Access log entries naming no outstanding ticket (duplicates, a previous incarnation's, expired)",
        )
        if self.table is not None:
            for reason, count in self.table.counters.ended.items():
                ended.add_metric([reason], count)
            unknown.add_metric([], self.table.counters.unknown)
        yield ended
        yield unknown


TICKETS = TicketCollector()
REGISTRY.register(TICKETS)


class TenantCollector:
    """Requests per tenant and tier, and each tenant's quota state, read from the decider at scrape time."""

    def __init__(self) -> None:
        self.decider = None

    def watch(self, decider) -> None:
        self.decider = decider

    def collect(self):
        requests = CounterMetricFamily(
            "tandem_coordinator_tier_requests",
            'Requests by tenant ("" for none), service tier and outcome (routed, rate_limited)',
            labels=["tenant", "tier", "outcome"],
        )
        refunded = CounterMetricFamily(
            "tandem_coordinator_tenant_refunded_tokens",
            "Tokens given back to a tenant's quota when its requests ended (max_tokens not used)",
            labels=["tenant"],
        )
        inflight = GaugeMetricFamily(
            "tandem_coordinator_tenant_inflight_requests", "A tenant's requests in flight", labels=["tenant"]
        )
        decider = self.decider
        if decider is not None:
            for (tenant, tier), (routed_count, limited) in list(decider.counters.tiers.items()):
                requests.add_metric([tenant, tier, "routed"], routed_count)
                requests.add_metric([tenant, tier, "rate_limited"], limited)
            quotas = decider.quotas
            for name in decider.tenants.specs:
                refunded.add_metric([name], quotas.counters.refunded_tokens.get(name, 0))
                inflight.add_metric([name], quotas.in_flight(name))
        yield requests
        yield refunded
        yield inflight


TENANTS = TenantCollector()
REGISTRY.register(TENANTS)
_routed_children: dict[str, Counter] = {}
_decision_children: dict[str, Counter] = {}


def decided(policy: str) -> None:
    """Counts one instance chosen by `policy`."""
    child = _decision_children.get(policy)
    if child is None:
        child = _decision_children[policy] = DECISIONS.labels(policy)
    child.inc()


def routed(instance_id: str) -> None:
    """Counts one routed request."""
    child = _routed_children.get(instance_id)
    if child is None:
        child = _routed_children[instance_id] = ROUTED.labels(instance_id)
    child.inc()


def pd_choice(model: str, choice: PairChoice) -> None:
    """Counts one joint P/D choice (`coordinator.scheduling.pd_joint.PairChoice`); the KV its prefill leg moves is
    counted when the leg completes (`kv_moved`)."""
    PD_CHOICES.labels(model, "local" if choice.prefill is None else "disaggregated").inc()


def kv_moved(nbytes: int, cross_node: bool) -> None:
    """Counts the KV one completed prefill leg of a P/D pair moved (`EndpointPicker.kv_moved`)."""
    if nbytes:
        KV_TRANSFER_BYTES.labels("cross_node" if cross_node else "intra_node").inc(nbytes)


# -- routing quality (`coordinator.routing_quality`) ---------------------------------------------------------------

_HIT_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREDICTED_HIT_TOKENS = Histogram(
    "tandem_coordinator_predicted_request_hit_tokens",
    "Prompt tokens the coordinator expected cached on the chosen instance, per cache tier, per routed request",
    ["model", "instance", "tier"],
    buckets=_HIT_BUCKETS,
)
PREDICTED_HIT_RATIO = Histogram(
    "tandem_coordinator_predicted_hit_ratio",
    "Share of the prompt the coordinator expected cached on the chosen instance (all tiers), per routed request",
    ["model", "instance"],
    buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
)
PREDICTED_TTFT_SECONDS = Histogram(
    "tandem_coordinator_predicted_ttft_seconds",
    "The chosen instance's predicted time to first token, per routed request",
    ["model", "instance"],
    buckets=_TTFT_BUCKETS,
)
ACTUAL_TTFT_SECONDS = Histogram(
    "tandem_coordinator_actual_ttft_seconds",
    "Time from sending a streamed request to the engine to its first byte (Envoy's timing), per request",
    ["model", "instance"],
    buckets=_TTFT_BUCKETS,
)
TIER_TTFT_SECONDS = Histogram(
    "tandem_coordinator_tier_ttft_seconds",
    "Time from sending a streamed request to the engine to its first byte (Envoy's timing), per service tier",
    ["tier"],
    buckets=_TTFT_BUCKETS,
)
TTFT_ERROR_RATIO = Histogram(
    "tandem_coordinator_ttft_error_ratio",
    "Actual over predicted TTFT of a streamed request (1: exact; above: slower than predicted)",
    ["model", "instance"],
    buckets=(0.25, 0.5, 0.8, 1.25, 2.0, 4.0, 10.0),
)


PREDICTED_HIT_TOKENS_TOTAL = Counter(
    "tandem_coordinator_predicted_hit_tokens",
    "Prompt tokens the coordinator expected cached on the instances it routed to (all tiers)",
    ["model", "instance"],
)
DELIVERED_HIT_TOKENS_TOTAL = Counter(
    "tandem_coordinator_delivered_hit_tokens",
    "Prompt tokens the engines found in their prefix cache (vllm:prefix_cache_hits_total, from heartbeats)",
    ["model", "instance"],
)


def routing_delivered(model: str, instance_id: str, tokens: int) -> None:
    """Counts prompt tokens an engine reported found cached since its previous heartbeat."""
    DELIVERED_HIT_TOKENS_TOTAL.labels(model, instance_id).inc(tokens)


def routing_predicted(prediction) -> None:
    """Observes one routed request's prediction (`routing_quality.Prediction`)."""
    model, instance = prediction.model, prediction.instance_id
    for tier, tokens in zip(("npu", "cpu", "disk"), prediction.hit_tokens, strict=True):
        PREDICTED_HIT_TOKENS.labels(model, instance, tier).observe(tokens)
    if prediction.prompt_tokens:
        PREDICTED_HIT_RATIO.labels(model, instance).observe(
            sum(prediction.hit_tokens) / prediction.prompt_tokens
        )
    PREDICTED_TTFT_SECONDS.labels(model, instance).observe(prediction.ttft_s)
    PREDICTED_HIT_TOKENS_TOTAL.labels(model, instance).inc(sum(prediction.hit_tokens))


def routing_actual_ttft(prediction, actual_s: float) -> None:
    """Observes a streamed request's actual TTFT and its ratio to the prediction."""
    model, instance = prediction.model, prediction.instance_id
    ACTUAL_TTFT_SECONDS.labels(model, instance).observe(actual_s)
    TIER_TTFT_SECONDS.labels(prediction.tier).observe(actual_s)
    if prediction.ttft_s > 0:
        TTFT_ERROR_RATIO.labels(model, instance).observe(actual_s / prediction.ttft_s)
