"""Service tiers and tenants: the pure rules (coordinator/tenants.py), the reloadable file
(coordinator/tenants_watch.py), and the decision applying them (through the ext_proc transport, no Envoy)."""

import json

import pytest

from coordinator.api_keys import ApiKeys
from coordinator.attempts import AttemptRegistry
from coordinator.decision import Decider
from coordinator.errors import OpenAIError
from coordinator.handoff import HandoffRunner
from coordinator.tenants import (
    TenantSpec,
    TenantTable,
    Tier,
    parse_tenants_file,
    requested_tier,
    resolve_tier,
)
from coordinator.tenants_watch import TenantsWatch, load_tenants
from coordinator.tickets import TicketTable
from coordinator.trigger import TriggerCoordinator
from tandem.config_file import ConfigError
from tests.coordinator.test_ext_proc import URL, body_message, process
from tests.helpers import make_picker

GOLD = TenantSpec(name="gold", keys=["k-gold"], default_tier="priority", max_tier="priority")
FREE = TenantSpec(name="free", keys=["k-free"], default_tier="flex")


def test_service_tier_values_are_openais():
    assert requested_tier({}) is None and requested_tier({"service_tier": "auto"}) is None
    assert requested_tier({"service_tier": None}) is None
    for tier in ("priority", "default", "flex"):
        assert requested_tier({"service_tier": tier}) == tier
    for bad in ("gold", "PRIORITY", 1, ["flex"]):
        with pytest.raises(OpenAIError) as err:
            requested_tier({"service_tier": bad})
        assert err.value.status == 400 and err.value.param == "service_tier"
        assert err.value.code == "invalid_value" and "Supported values are" in err.value.message


def test_a_tenant_gets_its_default_and_never_more_than_its_max_tier():
    assert resolve_tier(None, GOLD) == Tier.PRIORITY
    assert resolve_tier("flex", GOLD) == Tier.FLEX  # lowering is always allowed
    assert resolve_tier(None, FREE) == Tier.FLEX
    assert resolve_tier("default", FREE) == Tier.DEFAULT
    assert resolve_tier("priority", FREE) == Tier.DEFAULT  # cannot raise itself above max_tier
    assert resolve_tier(None, None) == Tier.DEFAULT
    assert resolve_tier("priority", None) == Tier.DEFAULT  # no tenant: default at most
    assert resolve_tier("flex", None) == Tier.FLEX


def test_tenant_entries_are_checked():
    with pytest.raises(ValueError, match="above max_tier"):
        TenantSpec(name="t", keys=["k"], default_tier="priority")
    with pytest.raises(ValueError):
        TenantSpec(name="t", keys=[])
    table = TenantTable([GOLD, FREE])
    assert table.tenant_of("Bearer k-gold") is GOLD and table.tenant_of("bearer  k-free ") is FREE
    assert table.tenant_of("Bearer nope") is None and table.tenant_of(None) is None
    assert table.tenant_of("Basic k-gold") is None
    assert sorted(table.keys) == ["k-free", "k-gold"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tenants: [", "not YAML"),
        ("- a", "expected a mapping with a `tenants:` list"),
        ("tenants: []\nextra: 1", "unknown key(s) extra"),
        ("tenants:\n- {name: a, keys: [k], requests_per_minute: 0}", "tenants[0].requests_per_minute"),
        ("tenants:\n- {name: a, keys: [k], max_tier: gold}", "tenants[0].max_tier"),
        ("tenants:\n- {name: a, keys: [k]}\n- {name: b, keys: [k]}", "reuses another tenant's key"),
        ("tenants:\n- {name: a, keys: [k]}\n- {name: a, keys: [j]}", "tenant 'a' appears twice"),
    ],
)
def test_a_malformed_tenants_file_is_one_line_naming_the_problem(text, expected):
    with pytest.raises(ConfigError) as err:
        parse_tenants_file(text)
    message = str(err.value)
    assert message.startswith("coordinator.tenants_file: ") and expected in message and "\n" not in message


def test_the_tenants_file_reloads_and_a_bad_one_keeps_the_last_good(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n- {name: a, keys: [ka]}\n")
    applied: list[TenantTable] = []
    watch = TenantsWatch([GOLD], str(path), applied.append)
    assert watch.poll() and sorted(applied[-1].specs) == ["a", "gold"]
    assert not watch.poll()  # unchanged
    path.write_text("tenants:\n- {name: a, keys: [ka], max_tier: platinum}\n")
    assert not watch.poll() and watch.errors == 1 and len(applied) == 1  # the last good table stays
    path.write_text("tenants:\n- {name: b, keys: [kb]}\n")
    assert watch.poll() and sorted(applied[-1].specs) == ["b", "gold"]
    path.write_text("tenants:\n- {name: gold, keys: [kx]}\n")  # clashes with the mesh file's entry
    assert not watch.poll() and watch.errors == 2
    with pytest.raises(ConfigError, match="appears twice"):
        load_tenants([GOLD], str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        load_tenants([], str(tmp_path / "missing.yaml"))


def decider_with(tenants, engine_priority=False, keys=()) -> Decider:
    picker = make_picker()
    runner = HandoffRunner(picker, 5.0, 2)
    trigger = TriggerCoordinator(runner, AttemptRegistry(), URL)
    tickets = TicketTable(picker.ledger, 60.0)
    return Decider(
        picker, runner, trigger, tickets, None, 8192, ApiKeys(keys), TenantTable(tenants), engine_priority
    )


async def test_tenant_keys_open_the_port_and_an_unknown_tier_is_400():
    decider = decider_with([GOLD, FREE])
    req = {"model": "m", "prompt": "hi", "max_tokens": 4}
    (denied,) = await process(decider, body_message(req))  # tenants configured: a key is needed
    assert denied.immediate_response.status.code == 401
    (ok,) = await process(decider, body_message(req, authorization="Bearer k-free"))
    assert ok.HasField("request_body")
    for path, body in (
        ("/v1/completions", {**req, "service_tier": "gold"}),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "service_tier": 3},
        ),
    ):
        (bad,) = await process(decider, body_message(body, path, authorization="Bearer k-gold"))
        assert bad.immediate_response.status.code == 400
        error = json.loads(bad.immediate_response.body)["error"]
        assert error["param"] == "service_tier" and error["type"] == "BadRequestError"
    assert decider.picker.ledger.total_requests == 1


async def test_engines_with_priority_scheduling_get_the_tier_as_vllm_priority():
    decider = decider_with([GOLD, FREE], engine_priority=True)
    cases = [
        ("k-gold", None, -1),  # gold's default: priority
        ("k-gold", "flex", 1),
        ("k-free", None, 1),  # free's default: flex
        ("k-free", "priority", 0),  # free cannot raise itself above default
        ("k-free", "auto", 1),
    ]
    for key, tier, priority in cases:
        req = {"model": "m", "prompt": "hi", "max_tokens": 4}
        if tier is not None:
            req["service_tier"] = tier
        (reply,) = await process(decider, body_message(req, authorization=f"Bearer {key}"))
        sent = json.loads(reply.request_body.response.body_mutation.body)
        assert sent["priority"] == priority, (key, tier)
        assert sent["prompt"] == "hi"
    plain = decider_with([GOLD])  # engines without the priority policy: the body goes as the client sent it
    (reply,) = await process(
        plain, body_message({"model": "m", "prompt": "hi"}, authorization="Bearer k-gold")
    )
    assert not reply.request_body.response.HasField("body_mutation")
