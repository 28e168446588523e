"""Golden bytes of `/v1/completions` and `/v1/chat/completions`, streamed and not, for every request shape the
serving layer shapes differently (logprobs, echo, stop strings, usage in the stream, n > 1, several prompts, EOS,
errors, P/D `kv_transfer_params`, an error chunk mid-stream).

The engines run in this process with the engine loop yielding after every step, so each wake-up of a streaming
handler sees exactly one new token per sequence: the chunking is deterministic, and so are the bytes. Only the
`created` timestamps, the per-process `system_fingerprint` and the P/D facts that name a free port or a random id
are normalised before comparing.

The golden file was recorded from the serving layer before its chunk encoders were split per API; to record it
again (only when a change of the wire is intended): `SIMENGINE_GOLDEN_UPDATE=1 pytest tests/simengine/test_openai_serving.py`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from simengine import engine as engine_module
from simengine.api_server import EngineServer
from simengine.config import parse_config

GOLDEN = Path(__file__).parent / "golden" / "openai_serving.json"
FAST = ("--speedup", "1000", "--max-model-len", "512", "--enable-request-id-headers")
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
#: A prompt whose echo needs JSON escapes (quotes, control characters, non-ASCII).
ESCAPED = 'say "hi"\n\tünïcode \\ done'
#: The answer to "hello world" starts " say run get water tire most soon": the stops below cut it there.
HELLO = {"prompt": "hello world"}

COMPLETIONS: dict[str, dict] = {
    "plain": {**HELLO, "max_tokens": 5},
    "ignore_eos_length": {"prompt": "two", "max_tokens": 6, "ignore_eos": True},
    "eos": {"prompt": "two", "max_tokens": 40},  # its natural length is 30: finishes on EOS
    "n2_two_prompts": {"prompt": ["one", "two"], "max_tokens": 3, "n": 2, "temperature": 1},
    "token_id_prompts": {"prompt": [[300, 301], [302]], "max_tokens": 2},
    "logprobs": {**HELLO, "max_tokens": 4, "logprobs": 2},
    "logprobs_zero": {**HELLO, "max_tokens": 3, "logprobs": 0},
    "echo": {"prompt": ESCAPED, "max_tokens": 3, "echo": True},
    "echo_logprobs": {"prompt": [300, 301, 302], "max_tokens": 3, "logprobs": 2, "echo": True},
    "stop_hit": {**HELLO, "max_tokens": 10, "stop": ["zzz", "water"]},
    "stop_mid_word": {**HELLO, "max_tokens": 10, "stop": "ti"},
    "stop_missed": {**HELLO, "max_tokens": 6, "stop": ["qqq"]},
    "stop_echo_logprobs": {**HELLO, "max_tokens": 10, "stop": "most", "echo": True, "logprobs": 1},
    "stop_min_tokens": {**HELLO, "max_tokens": 10, "stop": "say", "min_tokens": 3},
    "stop_eos": {"prompt": "two", "max_tokens": 40, "stop": ["qqq"]},
    "usage": {**HELLO, "max_tokens": 3, "stream_options": {"include_usage": True}},
    "continuous_usage": {
        "prompt": ["one", "two"],
        "max_tokens": 3,
        "n": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    },
    "continuous_usage_stop_logprobs": {
        **HELLO,
        "max_tokens": 10,
        "stop": "tire",
        "logprobs": 1,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    },
    "usage_without_continuous": {
        **HELLO,
        "max_tokens": 2,
        "stream_options": {"include_usage": False, "continuous_usage_stats": True},
    },
    "echo_n2_usage": {
        "prompt": "x",
        "max_tokens": 2,
        "n": 2,
        "echo": True,
        "stream_options": {"include_usage": True},
    },
    "too_long": {**HELLO, "max_tokens": 100000},
}
CHATS: dict[str, dict] = {
    "plain": {**CHAT, "max_completion_tokens": 3},
    "max_tokens": {**CHAT, "max_tokens": 4},
    "n2": {**CHAT, "max_tokens": 3, "n": 2, "temperature": 0.5},
    "logprobs": {**CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
    "logprobs_no_top": {**CHAT, "max_tokens": 2, "logprobs": True},
    "stop_hit": {**CHAT, "max_tokens": 10, "stop": ["clear"]},
    "stop_missed": {**CHAT, "max_tokens": 5, "stop": "qqq"},
    "usage": {**CHAT, "max_tokens": 3, "stream_options": {"include_usage": True}},
    "continuous_usage_n2": {
        **CHAT,
        "max_tokens": 3,
        "n": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    },
    "stop_n2_logprobs_continuous": {
        **CHAT,
        "max_tokens": 10,
        "n": 2,
        "stop": "clear",
        "logprobs": True,
        "top_logprobs": 1,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    },
    # Natural length 49: ends on EOS.
    "eos": {"messages": [{"role": "user", "content": "g"}], "max_tokens": 60},
    "escaped": {"messages": [{"role": "user", "content": ESCAPED}], "max_tokens": 2},
}

_NORMALISE = (
    (re.compile(rb'"created":\d+'), rb'"created":0'),
    (re.compile(rb'"vllm-0\.32\.0-[0-9a-f]{8}"'), rb'"vllm-fingerprint"'),
    (re.compile(rb'"remote_port":\d+'), rb'"remote_port":0'),
    (re.compile(rb'("remote_request_id":"[^"]*)-[0-9a-f]{8}"'), rb'\1-internal"'),
)


def normalise(body: bytes) -> str:
    for pattern, replacement in _NORMALISE:
        body = pattern.sub(replacement, body)
    return body.decode()


class InProcessEngine:
    """An EngineServer's app on a loopback test server, its engine loop and connector started."""

    def __init__(self, *args: str) -> None:
        self.server = EngineServer(parse_config([*FAST, *args]))
        self.http = TestServer(self.server.app)

    async def __aenter__(self) -> InProcessEngine:
        await self.http.start_server()
        self.server.engine.start()
        if self.server.connector is not None:
            await self.server.connector.start()
        self.session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()
        if self.server.connector is not None:
            await self.server.connector.stop()
        await self.server.engine.stop()
        await self.http.close()

    async def answer(self, path: str, body: dict, request_id: str) -> dict:
        """Status, the headers the serving layer sets, and the normalised body bytes."""
        headers = {"X-Request-Id": request_id}
        async with self.session.post(self.http.make_url(path), json=body, headers=headers) as resp:
            raw = await resp.read()
            kept = {k: resp.headers.get(k) for k in ("Content-Type", "Cache-Control", "X-Request-Id")}
            return {"status": resp.status, "headers": kept, "body": normalise(raw)}


async def record(engine: InProcessEngine, api: str, cases: dict[str, dict]) -> dict[str, dict]:
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    out = {}
    for name, body in cases.items():
        for stream in (False, True):
            key = f"{api}/{name}/{'stream' if stream else 'full'}"
            out[key] = await engine.answer(path, {**body, "stream": stream}, f"g-{name}")
    return out


def check(section: str, got: dict[str, dict]) -> None:
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("SIMENGINE_GOLDEN_UPDATE"):
        golden[section] = got
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
        return
    want = golden[section]
    differ = [key for key in want.keys() | got.keys() if want.get(key) != got.get(key)]
    assert not differ, f"answers differ from the golden bytes: {sorted(differ)}"
    assert got == want


@pytest.fixture(autouse=True)
def one_token_per_wake(monkeypatch):
    # The engine loop yields after every step, so a handler sees each step's tokens before the next one.
    monkeypatch.setattr(engine_module, "_MAX_BUSY_S", -1.0)


async def test_completions_and_chat_bytes():
    async with InProcessEngine() as engine:
        got = await record(engine, "completions", COMPLETIONS)
        got.update(await record(engine, "chat", CHATS))
    check("aggregated", got)


@pytest.mark.parametrize("connector", ["NixlConnector", "MooncakeConnector", "MooncakeLayerwiseConnector"])
async def test_handoff_prefill_answers_its_kv_transfer_params(connector):
    # The Mooncake names add their fields (the same with or without the Mooncake transfer engine installed).
    ktc = {"kv_connector": connector, "kv_role": "kv_producer", "engine_id": "golden-prefill"}
    async with InProcessEngine("--kv-transfer-config", json.dumps(ktc)) as engine:
        leg = {"kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}
        long_prompt = {"prompt": " ".join(["word"] * 40)}  # full blocks to hand over
        got = await record(
            engine, "completions", {"prefill": {**long_prompt, **leg}, "short": {**HELLO, **leg}}
        )
        got.update(await record(engine, "chat", {"prefill": {**CHAT, **leg}}))
    check(f"handoff_prefill/{connector}", got)


async def test_a_failed_sequence_ends_with_an_error_chunk():
    ktc = {"kv_connector": "MooncakeLayerwiseConnector", "kv_role": "kv_consumer"}
    args = ("--kv-transfer-config", json.dumps(ktc), "--fault-drop-callbacks", "--kv-transfer-timeout", "0.5")
    async with InProcessEngine(*args) as engine:
        # Prompt 0 waits for KV no prefill engine sends (its callback is dropped) and times out; prompt 1 is
        # computed here and streams first.
        trigger = {"do_remote_prefill": True, "metaserver": "http://127.0.0.1:9/callback"}
        body = {
            "prompt": ["one", "two"],
            "max_tokens": 3,
            "batch_kv_transfer_params": {"cmpl-g-mixed-0": trigger},
        }
        got = await record(engine, "completions", {"mixed": body})
    check("trigger_timeout", got)
