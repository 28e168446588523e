"""SLO-aware admission through the decision path: held decisions released as capacity frees, priority first,
429 `rejected: saturated` with retry-after past the bound or the TTL (or at once when late), a client that leaves
costs nothing, and every gauge back to zero."""

from __future__ import annotations

import asyncio
import json

from prometheus_client import REGISTRY

from coordinator.config import FlowControlSettings
from coordinator.flow_gate import FlowGate
from coordinator.services import AdminService
from coordinator.tenants import TenantSpec, Tier
from tandem.v1 import admin_pb2
from tests.coordinator.test_ext_proc import body_message, decision_metadata, process
from tests.coordinator.test_tenants import decider_with
from tests.helpers import eventually

GOLD = TenantSpec(name="gold", keys=["k-gold"], default_tier="priority", max_tier="priority")
BATCH = TenantSpec(name="batch", keys=["k-batch"], default_tier="flex", tokens_per_minute=1_000_000)
REQ = {"model": "m", "prompt": "hello there", "max_tokens": 50}


def tight(flex_queued: int = 2, flex_ttl: float = 10.0) -> FlowControlSettings:
    """SLOs no busy engine meets: an engine takes one request at a time (an idle one always fits)."""
    tier = {"ttft_slo_s": 1e-6, "tpot_slo_s": 1e-6, "max_queued": 8, "queue_ttl_s": 10.0}
    return FlowControlSettings(
        enabled=True,
        priority={**tier, "admit_on_expiry": True},
        default=tier,
        flex={**tier, "max_queued": flex_queued, "queue_ttl_s": flex_ttl},
    )


def gated(settings: FlowControlSettings):
    decider = decider_with([GOLD, BATCH])  # two idle engines, i0 and i1
    decider.flow = FlowGate(settings, decider.picker)
    decider.tickets.on_any_release = decider.flow.kick
    return decider


def send(decider, key: str) -> asyncio.Task:
    return asyncio.create_task(process(decider, body_message(REQ, authorization=f"Bearer {key}")))


def depth(tier: str) -> float:
    return REGISTRY.get_sample_value("tandem_coordinator_queue_depth", {"tier": tier})


def shed(tier: str, tenant: str, reason: str) -> float:
    labels = {"tier": tier, "tenant": tenant, "reason": reason}
    return REGISTRY.get_sample_value("tandem_coordinator_shed_total", labels) or 0.0


async def test_held_until_capacity_frees_priority_first_and_429_past_the_bound():
    decider = gated(tight(flex_queued=2))
    gate = decider.flow
    first = [await asyncio.wait_for(send(decider, "k-batch"), 5) for _ in range(2)]  # both engines, at once
    tickets = [decision_metadata(r)["ticket"] for (r,) in first]
    flex = [send(decider, "k-batch") for _ in range(2)]
    await eventually(lambda: gate.queues["m"].depth(Tier.FLEX) == 2, 5)
    before = shed("flex", "batch", "saturated")
    (refused,) = await asyncio.wait_for(send(decider, "k-batch"), 5)  # the flex queue is full
    immediate = refused.immediate_response
    assert immediate.status.code == 429
    error = json.loads(immediate.body)["error"]
    assert error["message"] == "rejected: saturated" and error["code"] == "rate_limit_exceeded"
    sent = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert int(sent["retry-after"]) >= 1
    assert shed("flex", "batch", "saturated") == before + 1
    prio = send(decider, "k-gold")  # arrives last, goes first
    await eventually(lambda: gate.queues["m"].depth(Tier.PRIORITY) == 1, 5)
    assert depth("priority") == 1 and depth("flex") == 2
    admin = AdminService(decider.picker, decider.counters, None, None, decider)
    stats = {(q.tier, q.tenant): q for q in (await admin.GetStats(admin_pb2.GetStatsRequest(), None)).queues}
    assert stats[("flex", "batch")].queued_now == 2 and stats[("flex", "batch")].admitted_at_once == 2
    assert stats[("flex", "batch")].shed_saturated == 1 and stats[("priority", "gold")].queued_now == 1
    assert decider.picker.ledger.total_requests == 2  # nothing held is committed

    decider.tickets.end(tickets[0], "completed", response_bytes=10)  # one engine frees
    (routed,) = await asyncio.wait_for(prio, 5)
    assert "ticket" in decision_metadata(routed)
    assert not any(t.done() for t in flex)
    tickets.append(decision_metadata(routed)["ticket"])
    for i, task in enumerate(flex):  # each end lets the next one go
        decider.tickets.end(tickets[1 + i], "completed", response_bytes=10)
        (reply,) = await asyncio.wait_for(task, 5)
        tickets.append(decision_metadata(reply)["ticket"])
    for ticket in tickets[3:]:
        decider.tickets.end(ticket, "completed", response_bytes=10)
    assert decider.picker.ledger.total_requests == 0
    assert len(gate.queues["m"]) == 0 and depth("priority") == 0 and depth("flex") == 0
    assert decider.quotas.in_flight("batch") == 0 and decider.quotas.in_flight("gold") == 0
    stats = {(q.tier, q.tenant): q for q in (await admin.GetStats(admin_pb2.GetStatsRequest(), None)).queues}
    assert stats[("flex", "batch")].queued_now == 0 and stats[("flex", "batch")].released == 2
    assert stats[("priority", "gold")].released == 1 and stats[("priority", "gold")].released_wait_seconds > 0


async def test_a_client_that_leaves_while_queued_costs_nothing():
    decider = gated(tight())
    gate = decider.flow
    busy = [await asyncio.wait_for(send(decider, "k-batch"), 5) for _ in range(2)]
    tokens_before = decider.quotas.usage["batch"].tokens.level
    waiting = send(decider, "k-batch")
    await eventually(lambda: gate.queues["m"].depth(Tier.FLEX) == 1, 5)
    assert decider.quotas.in_flight("batch") == 3
    waiting.cancel()  # Envoy cancels the call: the client left
    await asyncio.gather(waiting, return_exceptions=True)
    assert len(gate.queues["m"]) == 0 and depth("flex") == 0
    assert decider.quotas.in_flight("batch") == 2
    assert decider.quotas.usage["batch"].tokens.level >= tokens_before  # its charge came back
    assert decider.picker.ledger.total_requests == 2
    for (reply,) in busy:
        decider.tickets.end(decision_metadata(reply)["ticket"], "completed", response_bytes=10)
    assert gate._releasing == {} or not any(gate._releasing.values())


async def test_past_the_ttl_flex_gets_429_and_priority_goes_to_an_engine():
    decider = gated(tight(flex_ttl=0.2))
    settings = decider.flow.settings
    settings.priority.queue_ttl_s = 0.2
    decider.flow = FlowGate(settings, decider.picker)
    busy = [await asyncio.wait_for(send(decider, "k-batch"), 5) for _ in range(2)]
    before = shed("flex", "batch", "expired")
    (flex,), (prio,) = await asyncio.wait_for(
        asyncio.gather(send(decider, "k-batch"), send(decider, "k-gold")), 5
    )
    assert flex.immediate_response.status.code == 429
    assert json.loads(flex.immediate_response.body)["error"]["message"] == "rejected: saturated"
    assert shed("flex", "batch", "expired") == before + 1
    assert "ticket" in decision_metadata(prio)  # admitted past its TTL: the engines' priority queue has it
    assert depth("flex") == 0 and depth("priority") == 0
    for (reply,) in [*busy, (prio,)]:
        decider.tickets.end(decision_metadata(reply)["ticket"], "completed", response_bytes=10)
    assert decider.picker.ledger.total_requests == 0


async def test_priority_displaces_waiting_flex_when_the_queue_is_full():
    settings = tight(flex_queued=8)
    settings.max_queued_total = 2
    decider = gated(settings)
    gate = decider.flow
    busy = [await asyncio.wait_for(send(decider, "k-batch"), 5) for _ in range(2)]
    flex = [send(decider, "k-batch") for _ in range(2)]
    await eventually(lambda: gate.queues["m"].depth(Tier.FLEX) == 2, 5)
    prio = send(decider, "k-gold")
    done, _ = await asyncio.wait(flex, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    ((displaced,),) = [t.result() for t in done]
    assert displaced.immediate_response.status.code == 429
    assert gate.queues["m"].depth(Tier.PRIORITY) == 1 and gate.queues["m"].depth(Tier.FLEX) == 1
    tickets = [decision_metadata(r)["ticket"] for (r,) in busy]
    for ticket in tickets:
        decider.tickets.end(ticket, "completed", response_bytes=10)
    rest = await asyncio.wait_for(asyncio.gather(prio, *[t for t in flex if t not in done]), 5)
    for (reply,) in rest:
        decider.tickets.end(decision_metadata(reply)["ticket"], "completed", response_bytes=10)
    assert decider.picker.ledger.total_requests == 0 and len(gate.queues["m"]) == 0


async def test_a_flex_request_that_would_start_past_its_slo_gets_429_at_arrival():
    now = [0.0]
    settings = tight(flex_queued=8)
    settings.flex.ttft_slo_s = 0.5
    decider = gated(settings)
    gate = decider.flow = FlowGate(settings, decider.picker, clock=lambda: now[0])
    decider.tickets.on_any_release = gate.kick
    tickets = [decision_metadata(r)["ticket"] for (r,) in [await send(decider, "k-batch") for _ in range(2)]]
    flex = [send(decider, "k-batch") for _ in range(3)]
    await eventually(lambda: gate.queues["m"].depth(Tier.FLEX) == 3, 5)
    for i in range(2):  # two releases a second apart: one request's tokens a second
        now[0] += 1.0
        decider.tickets.end(tickets[i], "completed", response_bytes=10)
        (reply,) = await asyncio.wait_for(flex[i], 5)
        tickets.append(decision_metadata(reply)["ticket"])
    assert gate.queues["m"].wait_s(Tier.FLEX) == 1.0  # the one still waiting, past flex's 0.5 s
    before = shed("flex", "batch", "late")
    (refused,) = await asyncio.wait_for(send(decider, "k-batch"), 5)
    assert refused.immediate_response.status.code == 429
    assert json.loads(refused.immediate_response.body)["error"]["message"] == "rejected: saturated"
    sent = {h.header.key: h.header.raw_value.decode() for h in refused.immediate_response.headers.set_headers}
    assert sent["retry-after"] == "2"  # the one waiting and its own tokens, at the drain rate
    assert shed("flex", "batch", "late") == before + 1 and gate.queues["m"].depth(Tier.FLEX) == 1
    admin = AdminService(decider.picker, decider.counters, None, None, decider)
    stats = {(q.tier, q.tenant): q for q in (await admin.GetStats(admin_pb2.GetStatsRequest(), None)).queues}
    assert stats[("flex", "batch")].shed_late == 1
    decider.tickets.end(tickets[2], "completed", response_bytes=10)
    (reply,) = await asyncio.wait_for(flex[2], 5)
    for ticket in [*tickets[3:], decision_metadata(reply)["ticket"]]:
        decider.tickets.end(ticket, "completed", response_bytes=10)
    assert decider.picker.ledger.total_requests == 0 and len(gate.queues["m"]) == 0 and depth("flex") == 0
    assert decider.quotas.in_flight("batch") == 0


async def test_an_admitted_request_goes_to_an_engine_predicted_to_meet_its_slo():
    """i0 has fewer tokens committed (least_load's pick) but 20k prompt tokens queued, about 2 s to a first token;
    i1 more, almost all of them decode, a first token in milliseconds. Flex stops at half of priority's 1 s."""
    for flow, destination in ((True, "127.0.0.1:8101"), (False, "127.0.0.1:8100")):
        decider = gated(FlowControlSettings(enabled=True)) if flow else decider_with([GOLD, BATCH])
        ledger = decider.picker.ledger
        load = [
            ledger.commit("i0", 20_000, 10, 20_010, 20_000),
            ledger.commit("i1", 100, 50_000, 50_100, 100),
        ]
        (reply,) = await asyncio.wait_for(send(decider, "k-batch"), 5)
        assert decision_metadata(reply)["destination"] == destination  # without flow control: i0
        decider.tickets.end(decision_metadata(reply)["ticket"], "completed", response_bytes=10)
        for commitment in load:
            ledger.release(commitment)
        assert ledger.total_requests == 0
