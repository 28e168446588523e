"""Tenant quotas: the token buckets (coordinator/quotas.py, on a fake clock), and the decision applying them on
both transports, with the quota settled on every way a request ends (no Envoy)."""

import asyncio
import json
import time

import pytest
from envoy.service.auth.v3 import attribute_context_pb2 as ac
from envoy.service.auth.v3 import external_auth_pb2 as ea

from coordinator.ext_authz import Authorization
from coordinator.quotas import Quotas, RateLimited, go_duration, output_bound
from coordinator.tenants import TenantSpec
from coordinator.tickets import CLIENT_GONE, FAILED
from tests.coordinator.test_ext_proc import body_message, decision_metadata, process
from tests.coordinator.test_tenants import decider_with


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tenant(**limits) -> TenantSpec:
    return TenantSpec(name="t", keys=["k-t"], **limits)


def headers(admission_or_error) -> dict[str, str]:
    return dict(admission_or_error.headers)


def test_go_durations_as_openai_writes_them():
    assert go_duration(0) == "0s" and go_duration(0.017) == "17ms" and go_duration(1) == "1s"
    assert go_duration(1.5) == "1.5s" and go_duration(360) == "6m0s" and go_duration(90.25) == "1m30.25s"


def test_requests_per_minute_is_a_token_bucket_refilled_evenly():
    clock = Clock()
    quotas = Quotas(clock)
    spec = tenant(requests_per_minute=30)
    for i in range(30):  # a full bucket: a minute's worth at once
        admission = quotas.admit(spec, 10, 10)
        quotas.settle(admission)
        h = headers(admission)
        assert h["x-ratelimit-limit-requests"] == "30"
        assert h["x-ratelimit-remaining-requests"] == str(29 - i)
    assert h["x-ratelimit-reset-requests"] == "1m0s"  # empty: a full minute to refill
    with pytest.raises(RateLimited) as err:
        quotas.admit(spec, 10, 10)
    error = err.value
    assert error.status == 429 and error.type == "requests" and error.code == "rate_limit_exceeded"
    body = json.loads(error.body())["error"]
    assert body == {
        "message": error.message,
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert "Limit 30" in error.message and "try again in 2s" in error.message
    h = headers(error)
    assert h["retry-after"] == "2" and h["retry-after-ms"] == "2000"  # one request refills in 60/30 s
    assert h["x-ratelimit-remaining-requests"] == "0"
    clock.now += 2.0
    quotas.admit(spec, 10, 10)  # refilled
    assert quotas.counters.admitted["t"] == 31 and quotas.counters.limited["t"] == 1


def test_tokens_per_minute_counts_prompt_plus_max_tokens_and_is_corrected_at_the_end():
    clock = Clock()
    quotas = Quotas(clock)
    spec = tenant(tokens_per_minute=1000)
    first = quotas.admit(spec, 100, 400)
    assert headers(first)["x-ratelimit-remaining-tokens"] == "500"
    second = quotas.admit(spec, 100, 400)
    assert headers(second)["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimited) as err:
        quotas.admit(spec, 50, 50)
    assert err.value.type == "tokens" and headers(err.value)["retry-after-ms"] == "6000"
    quotas.settle(first, 20)  # it produced at most 20 tokens: 380 come back
    quotas.settle(first, 0)  # settled once only
    assert quotas.counters.refunded_tokens["t"] == 380
    quotas.admit(spec, 50, 50)
    with pytest.raises(RateLimited) as err:  # never fits: no retry-after, the message says why
        quotas.admit(spec, 900, 200)
    assert "Request too large" in err.value.message and "retry-after" not in headers(err.value)


def test_concurrency_is_released_by_every_settle():
    quotas = Quotas(Clock())
    spec = tenant(max_concurrency=2)
    a, b = quotas.admit(spec, 1, 1), quotas.admit(spec, 1, 1)
    with pytest.raises(RateLimited) as err:
        quotas.admit(spec, 1, 1)
    assert "in flight" in err.value.message and headers(err.value)["retry-after"] == "1"
    quotas.settle(a)
    quotas.settle(a)
    assert quotas.in_flight("t") == 1
    quotas.admit(spec, 1, 1)
    quotas.settle(b)
    assert quotas.in_flight("t") == 1


def test_a_reloaded_limit_keeps_the_level_capped():
    clock = Clock()
    quotas = Quotas(clock)
    for _ in range(10):
        quotas.admit(tenant(requests_per_minute=10), 1, 1)
    with pytest.raises(RateLimited):
        quotas.admit(tenant(requests_per_minute=100), 1, 1)  # a bigger bucket does not refill at once
    admission = quotas.admit(tenant(), 1, 1)  # the limit removed: no bucket, no header
    assert headers(admission) == {}


def test_two_replicas_sharing_their_use_hold_one_mesh_wide_limit():
    """Each replica charges its buckets with what the other took (its share's increase): together they admit the
    limit, not twice it; a refund on one fills the other's bucket too; the first share seen is only a baseline."""
    clock = Clock()
    spec = tenant(requests_per_minute=10, tokens_per_minute=1000)
    specs = {"t": spec}
    a, b = Quotas(clock), Quotas(clock)
    a.peer("b", b.share(), specs)  # baselines: nothing used yet
    b.peer("a", a.share(), specs)
    admitted = []
    for i in range(20):  # alternating replicas, each sharing after every decision
        here, there, name = (a, b, "a") if i % 2 == 0 else (b, a, "b")
        try:
            admitted.append(here.admit(spec, 40, 10))
        except RateLimited:
            pass
        there.peer(name, here.share(), specs)
    assert len(admitted) == 10  # the mesh-wide limit, not 10 per replica
    b_admission = admitted[1]
    b.settle(b_admission, output_bound=0)  # 10 tokens unused, given back on b ...
    a.peer("b", b.share(), specs)
    assert a.usage["t"].tokens.level == b.usage["t"].tokens.level  # ... and on a
    clock.now += 6  # a minute's tenth: one request refilled, on both copies
    assert a.admit(spec, 1, 1)
    with pytest.raises(RateLimited):
        a.admit(spec, 1, 1)


def test_a_peers_requests_in_flight_count_against_the_concurrency_limit_until_it_goes():
    spec = tenant(max_concurrency=2)
    a, b = Quotas(), Quotas()
    b.admit(spec, 1, 1)
    b.admit(spec, 1, 1)
    a.peer("b", b.share(), {"t": spec})
    with pytest.raises(RateLimited, match="requests in flight: Limit 2"):
        a.admit(spec, 1, 1)
    a.peer("b", None, {"t": spec})  # b died: its key's lease ended
    assert a.admit(spec, 1, 1)


def test_a_replicas_first_share_is_its_baseline_and_unknown_tenants_are_ignored():
    clock = Clock()
    spec = tenant(requests_per_minute=5)
    a = Quotas(clock)
    a.peer("b", {"t": (100, 0, 0), "gone": (7, 0, 0)}, {"t": spec})  # b's use before a saw it
    assert a.admit(spec, 1, 1)
    a.peer("b", {"t": (103, 0, 0), "gone": (9, 0, 0)}, {"t": spec})  # three more since
    assert a.usage["t"].requests.level == 1 and "gone" not in a.usage


def test_output_bound_from_the_response_size():
    assert output_bound(0, False, 100) == 0
    assert output_bound(40, False, 100) == 40 and output_bound(4000, False, 100) == 100
    assert output_bound(640, True, 100) == 10


COMPLETION = {"model": "m", "prompt": "hello there", "max_tokens": 50}


async def test_429_past_the_quota_with_headers_on_served_and_refused_replies():
    decider = decider_with([tenant(requests_per_minute=2, tokens_per_minute=100000)], engine_priority=False)
    served = []
    for _ in range(2):
        (reply,) = await process(decider, body_message(COMPLETION, authorization="Bearer k-t"))
        served.append(decision_metadata(reply))
    assert (
        served[0]["x-ratelimit-limit-requests"] == "2" and served[0]["x-ratelimit-remaining-requests"] == "1"
    )
    assert (
        served[1]["x-ratelimit-remaining-requests"] == "0"
        and served[1]["x-ratelimit-limit-tokens"] == "100000"
    )
    (refused,) = await process(decider, body_message(COMPLETION, authorization="Bearer k-t"))
    immediate = refused.immediate_response
    assert immediate.status.code == 429
    error = json.loads(immediate.body)["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    sent = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert sent["content-type"] == "application/json" and sent["retry-after"] == "30"
    assert sent["x-ratelimit-remaining-requests"] == "0" and sent["x-ratelimit-reset-requests"].endswith("s")
    assert decider.picker.ledger.total_requests == 2  # the refused request committed nothing
    # A request without a tenant's key carries no quota header (keys from the api_keys file).
    open_decider = decider_with([], keys=("plain",))
    (reply,) = await process(open_decider, body_message(COMPLETION, authorization="Bearer plain"))
    assert not any(k.startswith("x-ratelimit") for k in decision_metadata(reply))


async def test_ext_authz_carries_the_headers_on_the_reply_and_the_429():
    decider = decider_with([tenant(requests_per_minute=1)])
    authz = Authorization(decider)

    def check():
        http = ac.AttributeContext.HttpRequest(
            path="/v1/completions",
            method="POST",
            headers={"authorization": "Bearer k-t"},
            raw_body=json.dumps(COMPLETION).encode(),
        )
        request = ea.CheckRequest(
            attributes=ac.AttributeContext(request=ac.AttributeContext.Request(http=http))
        )
        return authz.Check(request, None)

    ok = await check()
    added = {h.header.key: h.header.value for h in ok.ok_response.response_headers_to_add}
    assert added["x-ratelimit-limit-requests"] == "1" and added["x-ratelimit-remaining-requests"] == "0"
    denied = await check()
    assert denied.denied_response.status.code == 429
    sent = {h.header.key: h.header.value for h in denied.denied_response.headers}
    assert sent["retry-after"] == "60" and sent["content-type"] == "application/json"


@pytest.mark.parametrize("end", ["completed", CLIENT_GONE, FAILED, "expired", "aborted", "no_engine"])
async def test_concurrency_is_released_on_every_end_path(end):
    decider = decider_with([tenant(max_concurrency=1, tokens_per_minute=1000)])
    quotas = decider.quotas
    if end == "no_engine":  # the pick fails (no healthy engine): the admission is undone at once
        for state in decider.picker.instances.all():
            state.drained = True
        (reply,) = await process(decider, body_message(COMPLETION, authorization="Bearer k-t"))
        assert reply.immediate_response.status.code == 503
        assert quotas.in_flight("t") == 0 and quotas.usage["t"].tokens.level == pytest.approx(1000)
        return
    (reply,) = await process(decider, body_message(COMPLETION, authorization="Bearer k-t"))
    ticket_id = decision_metadata(reply)["ticket"]
    assert quotas.in_flight("t") == 1
    (second,) = await process(decider, body_message(COMPLETION, authorization="Bearer k-t"))
    assert second.immediate_response.status.code == 429  # one in flight at most
    tickets = decider.tickets
    if end == "expired":
        tickets.expire(now=tickets.get(ticket_id).expires_at)
    elif end == "aborted":
        ticket = tickets.get(ticket_id)
        ticket.routed_at = 0.0  # as if the reply never reached Envoy
        tickets.abort(ticket)
    else:
        tickets.end(ticket_id, end, response_bytes=12)
    assert quotas.in_flight("t") == 0
    level = quotas.usage["t"].tokens.level
    if end == "expired":  # nothing known of its output: no correction
        assert level < 1000 - 50
    else:  # at most 12 output tokens (or none) were produced: the rest of max_tokens came back
        assert quotas.counters.refunded_tokens["t"] >= 50 - 12
    (again,) = await process(decider, body_message(COMPLETION, authorization="Bearer k-t"))
    assert again.HasField("request_body")


async def test_counters_per_tier_and_tenant_in_prometheus_and_get_stats():
    from prometheus_client import CollectorRegistry, generate_latest

    from coordinator.metrics import TenantCollector
    from coordinator.services import AdminService
    from tandem.v1 import admin_pb2

    gold = TenantSpec(name="gold", keys=["k-gold"], default_tier="priority", max_tier="priority")
    tiny = TenantSpec(name="tiny", keys=["k-tiny"], default_tier="flex", requests_per_minute=1)
    decider = decider_with([gold, tiny])
    collector = TenantCollector()
    collector.watch(decider)
    registry = CollectorRegistry()
    registry.register(collector)
    idle = generate_latest(registry).decode()
    assert 'tandem_coordinator_tenant_inflight_requests{tenant="gold"} 0.0' in idle  # idle gauges read 0
    tickets = []
    for key, tier in (("k-gold", None), ("k-gold", "flex"), ("k-tiny", None), ("k-tiny", None)):
        body = {**COMPLETION, **({"service_tier": tier} if tier else {})}
        (reply,) = await process(decider, body_message(body, authorization=f"Bearer {key}"))
        if reply.HasField("request_body"):
            tickets.append(decision_metadata(reply)["ticket"])
    text = generate_latest(registry).decode()
    assert (
        'tandem_coordinator_tier_requests_total{outcome="routed",tenant="gold",tier="priority"} 1.0' in text
    )
    assert 'tandem_coordinator_tier_requests_total{outcome="routed",tenant="gold",tier="flex"} 1.0' in text
    assert (
        'tandem_coordinator_tier_requests_total{outcome="rate_limited",tenant="tiny",tier="flex"} 1.0' in text
    )
    assert 'tandem_coordinator_tenant_inflight_requests{tenant="gold"} 2.0' in text
    admin = AdminService(decider.picker, decider.counters, None, None, decider)
    stats = await admin.GetStats(admin_pb2.GetStatsRequest(), None)
    tiers = {(t.tenant, t.tier): (t.requests_routed, t.requests_rate_limited) for t in stats.tiers}
    assert tiers == {("gold", "flex"): (1, 0), ("gold", "priority"): (1, 0), ("tiny", "flex"): (1, 1)}
    tenants = {t.tenant: t for t in stats.tenants}
    assert tenants["gold"].requests_inflight == 2 and tenants["tiny"].requests_rate_limited == 1
    for ticket in tickets:
        decider.tickets.end(ticket, "completed", response_bytes=10)
    stats = await admin.GetStats(admin_pb2.GetStatsRequest(), None)
    assert all(t.requests_inflight == 0 for t in stats.tenants) and stats.requests_inflight == 0
    assert (
        'tandem_coordinator_tenant_inflight_requests{tenant="gold"} 0.0' in generate_latest(registry).decode()
    )


async def test_a_request_at_the_concurrency_limit_waits_for_an_end_still_on_its_way():
    """Envoy reports a request's end up to its access-log flush later than the client sees it: a client that sends
    its next request at once finds the last one still counted. The decision waits up to `end_lag_s` for an end;
    past it (or with no lag configured), 429 as before."""
    decider = decider_with([tenant(max_concurrency=1)])
    decider.end_lag_s = 2.0
    (reply,) = await process(decider, body_message(COMPLETION, authorization="Bearer k-t"))
    ticket_id = decision_metadata(reply)["ticket"]
    loop = asyncio.get_running_loop()
    loop.call_later(
        0.05, decider.tickets.end, ticket_id, "completed", 12
    )  # the access log's entry, 50 ms late
    began = time.monotonic()
    (second,) = await process(decider, body_message(COMPLETION, authorization="Bearer k-t"))
    assert second.HasField("request_body") and 0.04 < time.monotonic() - began < 1.0
    decider.end_lag_s = 0.2  # the second one never ends: refused once the lag has passed
    began = time.monotonic()
    (third,) = await process(decider, body_message(COMPLETION, authorization="Bearer k-t"))
    assert third.immediate_response.status.code == 429 and 0.19 < time.monotonic() - began < 1.0
    assert decider.quotas.counters.limited["t"] == 1 and decider.quotas.in_flight("t") == 1
    decider.end_lag_s = 0.0
    began = time.monotonic()
    (fourth,) = await process(decider, body_message(COMPLETION, authorization="Bearer k-t"))
    assert fourth.immediate_response.status.code == 429 and time.monotonic() - began < 0.1
