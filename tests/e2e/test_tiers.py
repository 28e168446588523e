"""Service tiers and tenant quotas through `tandem up`: examples/tiers.yaml's tenants and engine settings on a
reduced fleet (two simulated engines on free ports). `tiny` gets 429 past its 30 requests a minute with OpenAI's
x-ratelimit-* headers (served replies carry them too), an unknown `service_tier` is a 400 on both routes, the OpenAI
SDK's own retry honours `retry-after`, and every in-flight count is back to zero afterwards."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.helpers import ROOT, RunningMesh, mesh_config, wait_until

EXAMPLE = yaml.safe_load((ROOT / "examples" / "tiers.yaml").read_text())
KEYS = dict(
    pair.split("=", 1)
    for line in (ROOT / "examples" / "tiers.yaml").read_text().splitlines()
    if line.startswith("# keys: ")
    for pair in line[len("# keys: ") :].split()
)
COMPLETION = {"model": "tandem-sim", "prompt": "The quick brown fox", "max_tokens": 4}


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module", params=["ext_proc", "ext_authz"])
def mesh(request, tmp_path_factory):
    """The example's tenants on each decision path: as the example runs it (engines scheduling by priority, so
    ext_proc), and on ext_authz (engines in arrival order: the tier is counted, not sent)."""
    example_engine = EXAMPLE["node_agents"][0]["engines"][0]
    priority = request.param == "ext_proc"
    args = [*example_engine["args"]] if priority else []
    config = mesh_config(engines=2, engine_args=[*args, "--speedup", "20"])
    workdir = tmp_path_factory.mktemp("tiers")
    # gold and free inline, tiny in the reloadable tenants file (as `tenants_file` takes them)
    tenants = EXAMPLE["coordinator"]["tenants"]
    config["coordinator"]["tenants"] = [t for t in tenants if t["name"] != "tiny"]
    tenants_file = workdir / "tenants.yaml"
    tenants_file.write_text(yaml.safe_dump({"tenants": [t for t in tenants if t["name"] == "tiny"]}))
    config["coordinator"]["tenants_file"] = str(tenants_file)
    config["coordinator"]["engine_priority"] = priority and EXAMPLE["coordinator"]["engine_priority"]
    config["envoy"]["decision"] = request.param
    running = RunningMesh(config, workdir)
    running.start()
    yield running
    if running.process.poll() is None:
        running.stop()


def test_the_example_names_its_three_tenants_keys():
    assert set(KEYS) == {"gold", "free", "tiny"}
    tenants = {t["name"]: t for t in EXAMPLE["coordinator"]["tenants"]}
    assert all(KEYS[name] in tenants[name]["keys"] for name in KEYS)
    assert tenants["gold"]["default_tier"] == "priority" and tenants["free"]["default_tier"] == "flex"
    assert tenants["tiny"]["requests_per_minute"] == 30


def test_unknown_service_tier_is_400_and_a_key_is_required(mesh):
    chat = {"model": "tandem-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", chat)):
        reply = httpx.post(
            mesh.http + path, json={**body, "service_tier": "platinum"}, headers=auth("gold"), timeout=30
        )
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "service_tier" and "platinum" in error["message"]
        ok = httpx.post(
            mesh.http + path, json={**body, "service_tier": "flex"}, headers=auth("gold"), timeout=30
        )
        assert ok.status_code == 200, ok.text
    assert httpx.post(mesh.http + "/v1/completions", json=COMPLETION, timeout=30).status_code == 401


def test_served_replies_carry_the_tenants_rate_limit_headers(mesh):
    reply = httpx.post(mesh.http + "/v1/completions", json=COMPLETION, headers=auth("gold"), timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-ratelimit-limit-requests"] == "600000"
    assert reply.headers["x-ratelimit-limit-tokens"] == "1000000000"
    assert int(reply.headers["x-ratelimit-remaining-requests"]) < 600000
    assert reply.headers["x-ratelimit-reset-requests"].endswith("s")


def test_tiny_gets_429_past_its_quota_then_the_sdk_retry_succeeds(mesh):
    served: list[httpx.Response] = []
    refused = None
    start = time.monotonic()
    with httpx.Client(base_url=mesh.http, headers=auth("tiny"), timeout=30) as client:
        for _ in range(45):  # 30 a minute: a bucket of 30, refilled one every 2 s
            reply = client.post("/v1/completions", json=COMPLETION)
            if reply.status_code == 429:
                refused = reply
                break
            assert reply.status_code == 200, reply.text
            served.append(reply)
    elapsed = time.monotonic() - start
    assert refused is not None, "tiny was never limited"
    assert 30 <= len(served) <= 30 + elapsed / 2 + 1
    remaining = [int(r.headers["x-ratelimit-remaining-requests"]) for r in served]
    assert all(r.headers["x-ratelimit-limit-requests"] == "30" for r in served)
    assert remaining[0] == 29 and min(remaining) == 0
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests" and error["param"] is None
    assert "30" in error["message"]
    assert refused.headers["x-ratelimit-limit-requests"] == "30"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(refused.headers["retry-after"]) <= 2 and int(refused.headers["retry-after-ms"]) <= 2000
    assert refused.headers["content-type"] == "application/json"

    # The OpenAI SDK's own retry: it sees the 429, waits what retry-after-ms says (at most 2 s), and succeeds. The
    # bucket refills one request every 2 s, so on a slow machine the SDK's first attempt may already pass: the bucket
    # is emptied right before each try, three tries at most.
    seen: list[int] = []
    http_client = httpx.Client(event_hooks={"response": [lambda r: seen.append(r.status_code)]})
    sdk = openai.OpenAI(
        base_url=mesh.http + "/v1", api_key=KEYS["tiny"], max_retries=3, http_client=http_client
    )
    for _ in range(3):
        for _ in range(3):  # empty again (one refill at most since the 429 above)
            drained = httpx.post(
                mesh.http + "/v1/completions", json=COMPLETION, headers=auth("tiny"), timeout=30
            )
            if drained.status_code == 429:
                break
        seen.clear()
        began = time.monotonic()
        completion = sdk.completions.create(model="tandem-sim", prompt="hello", max_tokens=2)
        assert completion.usage.completion_tokens == 2
        assert seen[-1] == 200 and len(seen) <= 4 and time.monotonic() - began < 15
        if seen[0] == 429:
            break
    assert seen[0] == 429, "the SDK never met a 429 to retry"
    http_client.close()

    for tier in (None, "flex"):  # gold: its default tier (priority), then one it asks for
        body = {**COMPLETION, **({"service_tier": tier} if tier else {})}
        assert (
            httpx.post(mesh.http + "/v1/completions", json=body, headers=auth("gold"), timeout=30).status_code
            == 200
        )

    def settled() -> bool:
        s = mesh.stats()
        return s.requests_inflight == 0 and all(t.requests_inflight == 0 for t in s.tenants)

    wait_until(settled, 15, "every request's end reached the coordinator")
    final = mesh.stats()
    tenants = {t.tenant: t for t in final.tenants}
    assert tenants["tiny"].requests_rate_limited >= 2 and tenants["tiny"].requests_admitted >= 31
    tiers = {(t.tenant, t.tier): t for t in final.tiers}
    assert tiers[("tiny", "default")].requests_rate_limited >= 2
    assert tiers[("gold", "priority")].requests_routed >= 1 and tiers[("gold", "flex")].requests_routed >= 1


def test_the_tenants_file_reloads_and_a_malformed_one_keeps_the_last_good(mesh):
    path = Path(mesh.config["coordinator"]["tenants_file"])
    good = yaml.safe_load(path.read_text())
    late = {"name": "late", "keys": ["sk-late"], "default_tier": "flex", "max_tier": "flex"}
    path.write_text(yaml.safe_dump({"tenants": [*good["tenants"], late]}))

    def late_served() -> bool:
        reply = httpx.post(
            mesh.http + "/v1/completions",
            json=COMPLETION,
            headers={"Authorization": "Bearer sk-late"},
            timeout=30,
        )
        return reply.status_code == 200

    wait_until(late_served, 15, "the new tenant's key accepted")
    path.write_text("tenants:\n- {name: late, keys: [sk-late], max_tier: platinum}\n")
    log = mesh.run_dir / "coordinator.log"

    def rejected_logged() -> bool:
        return any("tenants file rejected" in line for line in log.read_text().splitlines())

    wait_until(rejected_logged, 15, "the coordinator's one-line error")
    (line,) = [ln for ln in log.read_text().splitlines() if "tenants file rejected" in ln]
    assert "tenants[0].max_tier" in line
    assert late_served()  # the last good tenants stay
    path.write_text(yaml.safe_dump(good))
    wait_until(lambda: not late_served(), 15, "the tenant removed")
