"""P/D handoff: the prefill leg's body, retries on another prefill instance, and workload release."""

import json
import threading

import pytest
from aiohttp import web

from coordinator import handoff
from coordinator.config import PdMode
from coordinator.errors import OpenAIError
from coordinator.handoff import HandoffRunner, decode_body, prefill_body
from coordinator.instances import InstanceInfo
from tests.helpers import pd_picker

PARAMS = {
    "do_remote_prefill": True,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "p",
    "remote_host": "127.0.0.1",  # the prefill engine's own host (the coordinator checks it)
    "remote_port": 1,
    "tp_size": 1,
    "remote_request_id": "x",
}


def test_prefill_body_follows_the_vllm_proxy():
    body = {
        "model": "m",
        "prompt": "p",
        "stream": True,
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    leg = prefill_body(body)
    assert leg["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert leg["stream"] is False and leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "min_tokens" not in leg and "stream_options" not in leg and leg["temperature"] == 0
    assert body["stream"] is True and body["min_tokens"] == 5  # the client's body is untouched
    assert "max_completion_tokens" not in prefill_body({"model": "m", "prompt": "p"})


def test_decode_body_carries_the_prefill_params_verbatim():
    out = json.loads(decode_body({"model": "m", "prompt": "p", "stream": True}, PARAMS))
    assert out == {"model": "m", "prompt": "p", "stream": True, "kv_transfer_params": PARAMS}


async def fake_prefill(runners: list, status: int, seen: list, params=PARAMS):
    async def handler(request: web.Request) -> web.Response:
        seen.append((request.headers.get("X-Request-Id"), await request.json()))
        if status != 200:
            return web.json_response({"error": {"message": "boom"}}, status=status)
        return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": params})

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    runners.append(runner)
    return f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def servers():
    runners = []
    yield runners
    for r in runners:
        await r.cleanup()


async def test_failed_prefill_is_retried_on_another_instance(servers):
    seen_bad, seen_good = [], []
    bad = await fake_prefill(servers, 500, seen_bad)
    good = await fake_prefill(servers, 200, seen_good)
    picker = pd_picker([bad, good])
    decision = await picker.decide(
        "completions", json.dumps({"model": "m", "prompt": "hello", "stream": True}).encode(), "rid"
    )
    assert decision.mode == PdMode.HANDOFF and decision.target.instance.info.instance_id == "d0"
    runner = HandoffRunner(picker, 5.0, attempts=2)
    body = json.loads(await runner.run(decision, "/v1/completions"))
    await runner.close()
    assert body["kv_transfer_params"] == PARAMS and body["stream"] is True
    assert [rid for rid, _ in seen_bad + seen_good] == ["rid", "rid"]
    assert seen_good[0][1]["max_tokens"] == 1
    # only the decode leg holds workload now; the prefill legs were released
    assert picker.ledger.total_requests == 1 and picker.ledger.prefill_tokens("p0") == 0
    picker.release(decision.target)
    assert picker.ledger.total_tokens == 0


async def test_all_prefill_attempts_failing_is_503(servers):
    seen = []
    bad = [await fake_prefill(servers, 500, seen) for _ in range(3)]
    picker = pd_picker(bad)
    decision = await picker.decide("completions", json.dumps({"model": "m", "prompt": "hello"}).encode(), "r")
    runner = HandoffRunner(picker, 5.0, attempts=2)
    with pytest.raises(OpenAIError) as info:
        await runner.run(decision, "/v1/completions")
    await runner.close()
    assert info.value.status == 503 and "failed on 2 instance(s)" in info.value.message and len(seen) == 2
    picker.release(decision.target)
    assert picker.ledger.total_requests == 0


async def test_mixed_capabilities_are_refused():
    picker = pd_picker([])
    picker.instances.register(InstanceInfo("p9", "m", "127.0.0.1:2", "prefill", "trigger"))
    picker.instances.register(InstanceInfo("p8", "m", "127.0.0.1:3", "prefill", "handoff"))
    with pytest.raises(OpenAIError) as info:
        await picker.decide("completions", json.dumps({"model": "m", "prompt": "x"}).encode(), "r")
    assert info.value.status == 503 and "mix handoff-only and trigger-only" in info.value.message
    assert picker.ledger.total_requests == 0


async def test_multi_prompt_is_refused_in_pd_mode():
    picker = pd_picker(["127.0.0.1:5"])
    with pytest.raises(OpenAIError) as info:
        await picker.decide("completions", json.dumps({"model": "m", "prompt": ["a", "b"]}).encode(), "r")
    assert info.value.status == 400


async def test_storage_connectors_need_no_kv_transfer_params(servers):
    seen = []
    address = await fake_prefill(servers, 200, seen, params=None)
    body = json.dumps({"model": "m", "prompt": "hello"}).encode()
    nixl = pd_picker([address])
    runner = HandoffRunner(nixl, 5.0, attempts=1)
    with pytest.raises(OpenAIError, match="no kv_transfer_params"):
        await runner.run(await nixl.decide("completions", body, "r1"), "/v1/completions")
    example = pd_picker([address], connector="ExampleConnector")  # KV goes through shared storage
    runner = HandoffRunner(example, 5.0, attempts=1)
    decode = json.loads(await runner.run(await example.decide("completions", body, "r2"), "/v1/completions"))
    await runner.close()
    assert decode == {"model": "m", "prompt": "hello"} and seen[-1][1]["max_tokens"] == 1


async def test_prefill_params_naming_another_host_never_reach_the_decode_engine(servers):
    """A rogue prefill engine's answer aims the decode engine at another address: the leg counts as failed (and
    is retried elsewhere), so the decode engine never connects there."""
    seen = []
    rogue = await fake_prefill(servers, 200, seen, params={**PARAMS, "remote_host": "10.9.9.9"})
    picker = pd_picker([rogue])
    decision = await picker.decide("completions", json.dumps({"model": "m", "prompt": "hello"}).encode(), "r")
    runner = HandoffRunner(picker, 5.0, attempts=1)
    with pytest.raises(OpenAIError) as info:
        await runner.run(decision, "/v1/completions")
    await runner.close()
    assert info.value.status == 503 and "remote_host '10.9.9.9'" in info.value.message and len(seen) == 1
    picker.release(decision.target)
    assert picker.ledger.total_requests == 0


async def test_warm_imports_the_http_client_in_a_worker_thread(monkeypatch):
    calls = []
    monkeypatch.setattr(
        handoff.importlib, "import_module", lambda name: calls.append((name, threading.get_ident()))
    )
    runner = HandoffRunner(pd_picker([]), 5.0, 2)
    await runner.warm()
    assert calls and calls[0][0] == "aiohttp" and calls[0][1] != threading.get_ident()
