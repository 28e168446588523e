"""Routing-quality SLIs: the prediction kept with each routed request, the actual TTFT from Envoy's access log
entry, and the engines' delivered hits from their counters."""

from __future__ import annotations

import json

from envoy.service.accesslog.v3 import als_pb2
from prometheus_client import REGISTRY

from coordinator.access_log import AccessLogService
from coordinator.decision import new_request_ids
from coordinator.kv_facts import KvMatch
from coordinator.routing_quality import (
    DeliveredHits,
    Prediction,
    TtftAttainment,
    actual_ttft_s,
    prediction_of,
)
from tests.coordinator.test_access_log import entry
from tests.coordinator.test_ext_proc import decider_for
from tests.helpers import make_picker


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_the_prediction_counts_each_tier_once_up_to_the_prompt():
    match = KvMatch(npu_blocks=2, cpu_blocks=3, disk_blocks=4, block_size=16)
    p = prediction_of("m", "i0", match, 100, 0.2, True)
    assert p.hit_tokens == (32, 48, 20)  # the disk blocks beyond the prompt do not count
    assert prediction_of("m", "i0", KvMatch(), 100, 0.2, False).hit_tokens == (0, 0, 0)


def test_actual_ttft_is_the_engines_first_byte_after_the_request_reached_it():
    assert actual_ttft_s(0.010, 0.135) == 0.125
    assert actual_ttft_s(0.0, 0.1) is None  # never sent to an engine
    assert actual_ttft_s(0.01, 0.0) is None  # nothing came back


def test_delivered_hits_are_counter_deltas_and_survive_an_engine_restart():
    hits = DeliveredHits()
    assert hits.delta("i0", {0: 500}) == 0  # the first sample is the baseline
    assert hits.delta("i0", {0: 640, 1: 10}) == 150  # a new rank counts from zero
    assert hits.delta("i0", {0: 30, 1: 10}) == 30  # restarted: its counter starts again
    hits.forget("i0")
    assert hits.delta("i0", {0: 99}) == 0


async def test_a_routed_streamed_request_is_predicted_then_measured_from_its_log_entry():
    """Also its tier's TTFT (the dashboard's TTFT by tier) and the policy that chose (decisions per policy)."""
    decider = decider_for(make_picker("kv_affinity"))
    request = {"model": "m", "prompt": "hello there", "max_tokens": 4, "stream": True, "service_tier": "flex"}
    decisions = sample("tandem_coordinator_decisions_total", policy="kv_affinity")
    flex_ttfts = sample("tandem_coordinator_tier_ttft_seconds_count", tier="flex")
    routed = await decider.route("/v1/completions", json.dumps(request).encode(), new_request_ids(None))
    prediction = routed.ticket.prediction
    assert isinstance(prediction, Prediction) and prediction.streamed and prediction.ttft_s > 0
    assert prediction.tier == "flex"
    assert sample("tandem_coordinator_decisions_total", policy="kv_affinity") == decisions + 1
    instance = prediction.instance_id
    labels = {"model": "m", "instance": instance}
    assert sample("tandem_coordinator_predicted_ttft_seconds_count", **labels) >= 1
    assert sample("tandem_coordinator_predicted_request_hit_tokens_count", **labels, tier="npu") >= 1
    before = sample("tandem_coordinator_actual_ttft_seconds_count", **labels)
    decider.tickets.routed(routed.ticket)

    logged = entry("tandem", routed.ticket.id)
    logged.common_properties.time_to_first_upstream_tx_byte.FromMilliseconds(3)
    logged.common_properties.time_to_first_upstream_rx_byte.FromMilliseconds(53)

    async def messages():
        batch = als_pb2.StreamAccessLogsMessage()
        batch.http_logs.log_entry.append(logged)
        yield batch

    attainment = TtftAttainment({"flex": 0.01})
    await AccessLogService(decider.tickets, attainment).StreamAccessLogs(messages(), None)
    assert attainment.counts == {"flex": [1, 0]}  # 50 ms against a 10 ms objective
    assert sample("tandem_coordinator_actual_ttft_seconds_count", **labels) == before + 1
    assert sample("tandem_coordinator_tier_ttft_seconds_count", tier="flex") == flex_ttfts + 1
    assert sample("tandem_coordinator_tier_ttft_seconds_sum", tier="flex") > 0
    assert sample("tandem_coordinator_ttft_error_ratio_count", **labels) >= 1


def test_ttft_attainment_counts_each_tiers_requests_within_its_objective():
    book = TtftAttainment({"priority": 1.0, "default": 2.0})
    for tier, actual in [("priority", 0.4), ("priority", 1.5), ("default", 2.0), ("flex", 30.0)]:
        book.observe(tier, actual)
    assert book.counts == {"priority": [2, 1], "default": [1, 1], "flex": [1, 1]}  # no objective: met
