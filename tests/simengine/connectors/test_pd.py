"""P/D pairs against an aggregated engine: handoff (prefill first) and trigger (decode first, metaserver)."""

import asyncio
import copy
import json
import uuid

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import eventually, free_port

FAST = ("--speedup", "1000")


def ktc(connector: str, role: str) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_connector": connector, "kv_role": role})


BODY = {"prompt": "tell me about the cache server and the prefill engine " * 6, "max_tokens": 12,
        "ignore_eos": True}  # fmt: skip
CHAT = {
    "messages": [{"role": "user", "content": "explain decode " * 10}],
    "max_tokens": 8,
    "ignore_eos": True,
}


async def post(session, url, body, rid=None):
    headers = {"X-Request-Id": rid} if rid else {}
    async with session.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def stream_text(session, url, body, rid):
    text = []
    async with session.post(url, json={**body, "stream": True}, headers={"X-Request-Id": rid}) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(text)


def first_text(body):
    c = body["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


@pytest.fixture
def trio(engines):
    def start(connector):
        agg = engines(*FAST)
        p = engines(*FAST, *ktc(connector, "kv_producer"))
        d = engines(*FAST, *ktc(connector, "kv_consumer"))
        return agg, p, d

    return start


async def test_handoff_pair_matches_aggregated(trio):
    agg, p, d = trio("NixlConnector")
    async with aiohttp.ClientSession() as s:
        for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", CHAT)):
            _, expected = await post(s, agg.url + path, body)
            rid = uuid.uuid4().hex
            leg = {**body, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
                   "stream": False, "max_tokens": 1, "max_completion_tokens": 1}  # fmt: skip
            status, pre = await post(s, p.url + path, leg, rid)
            assert status == 200
            params = pre["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["remote_port"] > 0
            for key in (
                "remote_block_ids",
                "remote_engine_id",
                "remote_request_id",
                "remote_host",
                "tp_size",
            ):
                assert key in params
            status, dec = await post(s, d.url + path, {**body, "kv_transfer_params": params}, rid)
            assert status == 200 and first_text(dec) == first_text(expected)
    assert d.metric("simengine:kv_transfer_tokens_total") > 0
    assert (
        d.metric(
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="sim-8b",source="external_kv_transfer"}'
        )
        > 0
    )
    assert d.metric("simengine:kv_transfer_fallbacks_total") == 0


async def test_handoff_streaming_and_mooncake_fields(trio):
    agg, p, d = trio("MooncakeConnector")
    async with aiohttp.ClientSession() as s:
        expected = await stream_text(s, agg.url + "/v1/completions", BODY, "x")
        rid = uuid.uuid4().hex
        leg = {**BODY, "kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1, "min_tokens": 1}
        _, pre = await post(s, p.url + "/v1/completions", leg, rid)
        params = pre["kv_transfer_params"]
        assert {"remote_pcp_size", "remote_dcp_size", "last_token_id", "num_prompt_blocks"} <= set(params)
        got = await stream_text(s, d.url + "/v1/completions", {**BODY, "kv_transfer_params": params}, rid)
    assert got == expected


#: Two prompts sharing a long document: the second finds the document's blocks in the decode engine's cache.
DOC = "the cache server keeps each block of the shared document for every question " * 8
FIRST = {"prompt": DOC + "what is the first question", "max_tokens": 4, "ignore_eos": True}
SECOND = {"prompt": DOC + "and now a different question", "max_tokens": 4, "ignore_eos": True}
KV_BYTES_PER_BLOCK = 4096  # simengine's default `--kv-bytes-per-block`


async def handoff(s, agg, p, d, body, rid):
    """One request through the pair (prefill leg, then decode leg): the decode engine's answer and the
    aggregated engine's, and the decode engine's pulled bytes, transferred tokens and prefix hits it took."""
    before = [d.metric(m) for m in ("simengine:kv_transfer_bytes_total", "simengine:kv_transfer_tokens_total",
                                    "vllm:prefix_cache_hits_total")]  # fmt: skip
    _, expected = await post(s, agg.url + "/v1/completions", body)
    leg = {**body, "kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}
    _, pre = await post(s, p.url + "/v1/completions", leg, rid)
    params = pre["kv_transfer_params"]
    status, out = await post(s, d.url + "/v1/completions", {**body, "kv_transfer_params": params}, rid)
    assert status == 200
    after = [d.metric(m) for m in ("simengine:kv_transfer_bytes_total", "simengine:kv_transfer_tokens_total",
                                   "vllm:prefix_cache_hits_total")]  # fmt: skip
    moved, tokens, hit = (a - b for a, b in zip(after, before, strict=True))
    return first_text(out), first_text(expected), len(params["remote_block_ids"][0]), moved, tokens, hit


@pytest.mark.parametrize("connector", ["NixlConnector", "MooncakeConnector"])
async def test_handoff_pulls_only_the_blocks_the_decode_engine_lacks(trio, connector):
    """As vLLM's NixlConnector (`get_num_new_matched_tokens`: the prompt minus the locally computed tokens; only
    the unhashed blocks are read) and vLLM-Ascend's Mooncake connector: the second request's document is in the
    decode engine's cache already."""
    agg, p, d = trio(connector)
    async with aiohttp.ClientSession() as s:
        got, expected, blocks, moved, tokens, hit = await handoff(s, agg, p, d, FIRST, "first")
        assert got == expected and hit == 0
        assert moved == blocks * KV_BYTES_PER_BLOCK and tokens == blocks * 16
        got, expected, blocks, moved, tokens, hit = await handoff(s, agg, p, d, SECOND, "second")
    assert got == expected and hit >= 16 * 8  # the document's leading blocks
    assert moved == (blocks - hit // 16) * KV_BYTES_PER_BLOCK and tokens == blocks * 16 - hit
    assert d.metric("simengine:kv_transfer_fallbacks_total") == 0


async def test_bad_params_and_failed_pull_fall_back(trio):
    agg, p, d = trio("NixlConnector")
    async with aiohttp.ClientSession() as s:
        _, expected = await post(s, agg.url + "/v1/completions", BODY)
        bad = {"do_remote_prefill": True, "remote_host": 7}
        status, out = await post(s, d.url + "/v1/completions", {**BODY, "kv_transfer_params": bad}, "b1")
        assert status == 200 and first_text(out) == first_text(expected)
        dead = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port(),
                "remote_request_id": "gone", "remote_block_ids": [[1, 2]], "remote_engine_id": "x"}  # fmt: skip
        status, out = await post(s, d.url + "/v1/completions", {**BODY, "kv_transfer_params": dead}, "b2")
        assert status == 200 and first_text(out) == first_text(expected)
    assert d.metric("simengine:kv_transfer_fallbacks_total") == 2
    assert d.metric("simengine:kv_transfer_failures_total") == 1


async def test_handoff_prompt_shorter_than_a_block_needs_no_pull(trio):
    agg, p, d = trio("NixlConnector")
    body = {"prompt": "short", "max_tokens": 5, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        _, expected = await post(s, agg.url + "/v1/completions", body)
        leg = {**body, "kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}
        _, pre = await post(s, p.url + "/v1/completions", leg, "short")
        assert pre["kv_transfer_params"]["remote_block_ids"] == [[]]
        _, out = await post(
            s, d.url + "/v1/completions", {**body, "kv_transfer_params": pre["kv_transfer_params"]}
        )
    assert first_text(out) == first_text(expected)
    assert (
        d.metric("simengine:kv_transfer_fallbacks_total") == 0
        and d.metric("simengine:kv_transfer_tokens_total") == 0
    )


class FakeMetaserver:
    """Answers the decode engine's callback as the coordinator's Metaserver does: sends the prefill leg (the
    original body with kv_transfer_params = the callback body, stream=false, max_tokens=1, min_tokens=1, same
    X-Request-Id) and answers {"status":"ok"} once it completed; unknown ids get 404; duplicates do not prefill
    twice."""

    def __init__(self, prefill_url: str, path: str):
        self.prefill_url = prefill_url
        self.path = path
        self.expected: dict[str, tuple[str, dict]] = {}
        self.callbacks: list[dict] = []
        self.prefills = 0
        self.done: dict[str, asyncio.Future] = {}
        self.groups: dict[str, list[str]] = {}
        self.arrived: dict[str, dict[str, dict]] = {}
        self.dispatched: set[str] = set()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/metaserver"

    def expect(self, callback_id: str, x_request_id: str, body: dict, children: int = 1) -> None:
        self.expected[callback_id] = (x_request_id, body)
        if children > 1:
            base = callback_id.rsplit("-", 1)[0]
            self.groups[x_request_id] = [f"{base}-{i}" for i in range(children)]
            for child in self.groups[x_request_id]:
                self.expected[child] = (x_request_id, body)

    async def handle(self, request: web.Request) -> web.Response:
        cb = await request.json()
        self.callbacks.append(cb)
        entry = self.expected.get(cb["request_id"])
        if entry is None:
            return web.json_response({"error": "unknown request"}, status=404)
        rid, original = entry
        group = self.groups.get(rid, [cb["request_id"]])
        self.arrived.setdefault(rid, {})[cb["request_id"]] = cb
        fut = self.done.get(rid)
        if fut is None:
            fut = self.done[rid] = asyncio.get_running_loop().create_future()
        # dispatch once, when every child of a (multi-prompt) request has called back
        if len(self.arrived[rid]) == len(group) and rid not in self.dispatched:
            self.dispatched.add(rid)
            leg = copy.deepcopy(original)
            leg.pop("stream_options", None)
            leg.update(
                kv_transfer_params=cb, stream=False, max_tokens=1, min_tokens=1, max_completion_tokens=1
            )
            if len(group) > 1:
                leg["batch_kv_transfer_params"] = dict(self.arrived[rid])
            self.prefills += 1
            async with aiohttp.ClientSession() as s:
                async with s.post(self.prefill_url + self.path, json=leg, headers={"X-Request-Id": rid}) as r:
                    fut.set_result(r.status)
        status = await fut
        ok = status == 200
        return web.json_response(
            {"status": "ok"} if ok else {"error": "prefill failed"}, status=200 if ok else 502
        )

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/v1/metaserver", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


async def run_trigger(agg, p, d, path, body, stream=False, duplicate_expected=False):
    async with aiohttp.ClientSession() as s, FakeMetaserver(p.url, path) as meta:
        rid = uuid.uuid4().hex
        callback_id = f"chatcmpl-{rid}" if "chat" in path else f"cmpl-{rid}-0"
        req_body = {**body, "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": True,
                                                    "metaserver": meta.url}}  # fmt: skip
        meta.expect(callback_id, rid, req_body)
        if stream:
            got = await stream_text(s, d.url + path, req_body, rid)
            expected = await stream_text(s, agg.url + path, body, "agg")
        else:
            status, out = await post(s, d.url + path, req_body, rid)
            assert status == 200, out
            got = first_text(out)
            expected = first_text((await post(s, agg.url + path, body))[1])
        # a duplicate callback may land after the answer; the handler counts a prefill in the same step
        await eventually(lambda: len(meta.callbacks) == (2 if duplicate_expected else 1), 5, "the callbacks")
        return got, expected, meta


async def test_trigger_pair_matches_aggregated(trio):
    agg, p, d = trio("MooncakeLayerwiseConnector")
    got, expected, meta = await run_trigger(agg, p, d, "/v1/completions", BODY)
    assert got == expected and meta.prefills == 1
    cb = meta.callbacks[0]
    assert list(cb) == ["token_ids", "request_id", "do_remote_prefill", "do_remote_decode", "remote_block_ids",
                        "remote_block_size", "remote_engine_id", "remote_host", "remote_port", "remote_tp_size",
                        "remote_pcp_size", "remote_dcp_size", "remote_cached_tokens"]  # fmt: skip
    assert cb["do_remote_decode"] is True and cb["do_remote_prefill"] is False and cb["remote_block_ids"][0]
    got, expected, _ = await run_trigger(agg, p, d, "/v1/chat/completions", CHAT, stream=True)
    assert got == expected
    assert d.metric("simengine:kv_transfer_tokens_total") > 0
    assert (
        d.metric(
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="sim-8b",source="external_kv_transfer"}'
        )
        > 0
    )


async def test_trigger_pushes_only_the_blocks_the_decode_engine_lacks(trio):
    """The callback names the decode engine's own hit (`remote_cached_tokens`); the prefill engine pushes the blocks
    after it (vLLM-Ascend's layerwise connector starts sending there)."""
    agg, p, d = trio("MooncakeLayerwiseConnector")
    got, expected, meta = await run_trigger(agg, p, d, "/v1/completions", FIRST)
    assert got == expected and meta.callbacks[0]["remote_cached_tokens"] == 0
    sent = p.metric("simengine:kv_transfer_bytes_total")
    assert sent == len(meta.callbacks[0]["remote_block_ids"][0]) * KV_BYTES_PER_BLOCK
    arrived, prompts = d.metric("simengine:kv_transfer_tokens_total"), p.metric("vllm:prompt_tokens_total")
    got, expected, meta = await run_trigger(agg, p, d, "/v1/completions", SECOND)
    cb = meta.callbacks[0]
    assert got == expected and cb["remote_cached_tokens"] >= 16 * 8
    skipped = cb["remote_cached_tokens"] // 16
    assert (
        p.metric("simengine:kv_transfer_bytes_total") - sent
        == (len(cb["remote_block_ids"][0]) - skipped) * KV_BYTES_PER_BLOCK
    )
    # The decode engine counts the prompt tokens it was sent, not those it held.
    prompt = p.metric("vllm:prompt_tokens_total") - prompts
    assert d.metric("simengine:kv_transfer_tokens_total") - arrived == prompt - skipped * 16


async def test_trigger_duplicate_callbacks_prefill_once(engines):
    agg = engines(*FAST)
    p = engines(*FAST, *ktc("MooncakeLayerwiseConnector", "kv_producer"))
    d = engines(*FAST, *ktc("MooncakeLayerwiseConnector", "kv_consumer"), "--fault-duplicate-callbacks")
    got, expected, meta = await run_trigger(agg, p, d, "/v1/completions", BODY, duplicate_expected=True)
    assert got == expected and len(meta.callbacks) == 2 and meta.prefills == 1


async def test_trigger_times_out_clearly_when_callback_dropped(engines):
    p = engines(*FAST, *ktc("MooncakeLayerwiseConnector", "kv_producer"))
    d = engines(*FAST, *ktc("MooncakeLayerwiseConnector", "kv_consumer"), "--fault-drop-callbacks",
                "--kv-transfer-timeout", "0.5")  # fmt: skip
    async with aiohttp.ClientSession() as s, FakeMetaserver(p.url, "/v1/completions") as meta:
        body = {**BODY, "kv_transfer_params": {"do_remote_prefill": True, "metaserver": meta.url}}
        status, out = await post(s, d.url + "/v1/completions", body, "t1")
    assert status == 500 and "timed out" in out["error"]["message"] and meta.callbacks == []
    assert d.metric("simengine:kv_transfer_failures_total") == 1


async def test_trigger_callback_rejected_three_times(engines):
    d = engines(*FAST, *ktc("MooncakeLayerwiseConnector", "kv_consumer"))
    async with aiohttp.ClientSession() as s, FakeMetaserver("http://127.0.0.1:1", "/v1/completions") as meta:
        body = {**BODY, "kv_transfer_params": {"do_remote_prefill": True, "metaserver": meta.url}}
        status, out = await post(s, d.url + "/v1/completions", body, "unknown")
    assert status == 500 and "3 tries" in out["error"]["message"] and "404" in out["error"]["message"]
    assert len(meta.callbacks) == 3


async def test_trigger_multi_prompt_batch_params(trio):
    agg, p, d = trio("MooncakeLayerwiseConnector")
    body = {"prompt": ["first prompt about the cache " * 5, "second prompt about decode " * 5], "max_tokens": 6,
            "ignore_eos": True}  # fmt: skip
    async with aiohttp.ClientSession() as s, FakeMetaserver(p.url, "/v1/completions") as meta:
        rid = uuid.uuid4().hex
        req_body = {**body, "kv_transfer_params": {"do_remote_prefill": True, "metaserver": meta.url}}
        meta.expect(f"cmpl-{rid}-0", rid, req_body, children=2)
        status, out = await post(s, d.url + "/v1/completions", req_body, rid)
        _, expected = await post(s, agg.url + "/v1/completions", body)
    assert status == 200, out
    assert [c["text"] for c in out["choices"]] == [c["text"] for c in expected["choices"]]
    assert meta.prefills == 1
    assert sorted(cb["request_id"] for cb in meta.callbacks) == [f"cmpl-{rid}-0", f"cmpl-{rid}-1"]


async def test_example_connector_shared_storage(engines, tmp_path):
    """vLLM's CPU P/D recipe: the prefill engine stores the prompt's KV in a shared directory, the decode engine
    given the same prompt loads it and counts the tokens as external_kv_transfer."""
    cfg = {
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    agg = engines(*FAST)
    p = engines(*FAST, "--kv-transfer-config", json.dumps({**cfg, "kv_role": "kv_producer"}))
    d = engines(*FAST, "--kv-transfer-config", json.dumps({**cfg, "kv_role": "kv_consumer"}))
    async with aiohttp.ClientSession() as s:
        _, expected = await post(s, agg.url + "/v1/completions", BODY)
        status, _ = await post(s, p.url + "/v1/completions", {**BODY, "max_tokens": 1})
        assert status == 200 and list(tmp_path.iterdir())
        _, out = await post(s, d.url + "/v1/completions", BODY)
    assert first_text(out) == first_text(expected)
    external = (
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="sim-8b",source="external_kv_transfer"}'
    )
    assert d.metric(external) > 0 and d.metric("simengine:kv_transfer_fallbacks_total") == 0


needs_mooncake = pytest.mark.skipif(
    __import__("simengine.connectors.mooncake_transport", fromlist=["available"]).available() is not None,
    reason="Mooncake transfer engine not installed (the `mooncake` extra and Debian libibverbs1)",
)


@needs_mooncake
async def test_mooncake_handoff_moves_bytes_through_the_transfer_engine(trio):
    """The decode engine reads the prefill engine's blocks with the real transfer engine (TCP), checks the bytes
    the prefill side wrote, and its done signal frees the prefill side's held blocks."""
    agg, p, d = trio("MooncakeConnector")
    async with aiohttp.ClientSession() as s:
        _, expected = await post(s, agg.url + "/v1/completions", BODY)
        leg = {**BODY, "kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1, "min_tokens": 1}
        _, pre = await post(s, p.url + "/v1/completions", leg, "mc1")
        params = pre["kv_transfer_params"]
        blocks = len(params["remote_block_ids"][0])
        assert blocks >= 2 and params["remote_host"] == "127.0.0.1"
        assert p.metric("vllm:kv_cache_usage_perc") > 0  # held for the decode engine
        status, dec = await post(s, d.url + "/v1/completions", {**BODY, "kv_transfer_params": params}, "mc1")
        assert status == 200 and first_text(dec) == first_text(expected)
    assert (
        d.metric("simengine:kv_transfer_bytes_total") == blocks * 4096
    )  # --kv-bytes-per-block, K and V halves
    assert d.metric("simengine:kv_transfer_failures_total") == 0
    assert d.metric("simengine:kv_transfer_fallbacks_total") == 0
    assert p.metric("vllm:kv_cache_usage_perc") == 0  # freed by the done signal, not the 120 s expiry


@needs_mooncake
async def test_mooncake_failed_transfer_goes_on_like_vllm_ascend(trio):
    """vLLM-Ascend logs a failed read and finishes the request without recomputing: no fallback, one failure."""
    agg, p, d = trio("MooncakeConnector")
    dead = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": free_port(),
            "remote_request_id": "gone", "remote_block_ids": [[1, 2]], "remote_engine_id": "x"}  # fmt: skip
    async with aiohttp.ClientSession() as s:
        _, expected = await post(s, agg.url + "/v1/completions", BODY)
        status, out = await post(s, d.url + "/v1/completions", {**BODY, "kv_transfer_params": dead}, "mc2")
        assert status == 200 and first_text(out) == first_text(expected)
    assert d.metric("simengine:kv_transfer_failures_total") == 1
    assert d.metric("simengine:kv_transfer_fallbacks_total") == 0
