"""simengine against real vLLM 0.32 (CPU, tiny model): the same table of requests to both, compared by status,
headers and structure (never generated text); KV events compared field by field, block hashes byte for byte,
sequence numbers and replay included. Differences must be in `ALLOWED` (mirrored in docs/simengine.md)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_until
from tests.vllm.conformance import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MODEL_NAME,
    USABLE_BLOCKS,
    Case,
    compare,
    replay,
    send,
    shape,
    start_engines,
    unexplained,
)

M = MODEL_NAME


def ids(n: int, start: int = 40) -> list[int]:
    """`n` prompt token ids of the tiny vocabulary, distinct per `start`."""
    return [(start + 7 * i) % 900 + 20 for i in range(n)]


def cmpl(**body) -> dict:
    return {"model": M, "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 4,
            "ignore_eos": True, **body}  # fmt: skip


def chat(**body) -> dict:
    return {"model": M, "messages": [{"role": "user", "content": "Tell me about the weather today"}],
            "max_tokens": 4, "ignore_eos": True, **body}  # fmt: skip


RID = {"X-Request-Id": "conformance-fixed-id"}

CASES = [
    # completions, not streamed
    Case("cmpl_text", "/v1/completions", cmpl()),
    Case("cmpl_no_model", "/v1/completions", {k: v for k, v in cmpl().items() if k != "model"}),
    Case("cmpl_list", "/v1/completions", cmpl(prompt=["first prompt here", "second prompt there"])),
    Case("cmpl_token_ids", "/v1/completions", cmpl(prompt=ids(10))),
    Case("cmpl_token_id_lists", "/v1/completions", cmpl(prompt=[ids(6), ids(9, 3)])),
    Case("cmpl_n2", "/v1/completions", cmpl(n=2, temperature=1.0)),
    Case("cmpl_stop", "/v1/completions", cmpl(stop=["zzzzqqq"], max_tokens=5)),
    Case("cmpl_length", "/v1/completions", cmpl(max_tokens=2)),
    Case("cmpl_eos_allowed", "/v1/completions", cmpl(ignore_eos=False, max_tokens=3)),
    Case("cmpl_logprobs", "/v1/completions", cmpl(logprobs=2)),
    Case("cmpl_logprobs0", "/v1/completions", cmpl(logprobs=0)),
    Case("cmpl_echo", "/v1/completions", cmpl(echo=True)),
    Case("cmpl_echo_logprobs", "/v1/completions", cmpl(echo=True, logprobs=1, prompt=ids(5))),
    Case("cmpl_request_id", "/v1/completions", cmpl(), headers=RID),
    # prompt + max_tokens beyond the context: 200, max_tokens cut to the 12 tokens that fit
    Case("cmpl_overlong_budget", "/v1/completions", cmpl(prompt=ids(MAX_MODEL_LEN - 12), max_tokens=100)),
    Case("cmpl_lax_types", "/v1/completions", cmpl(max_tokens="3", ignore_eos="yes", n="1", temperature="0")),
    # completions, streamed
    Case("cmpl_stream", "/v1/completions", cmpl(stream=True), stream=True),
    Case(
        "cmpl_stream_usage",
        "/v1/completions",
        cmpl(stream=True, stream_options={"include_usage": True}),
        stream=True,
    ),  # fmt: skip
    Case(
        "cmpl_stream_continuous",
        "/v1/completions",
        cmpl(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
        stream=True,
    ),
    Case("cmpl_stream_logprobs", "/v1/completions", cmpl(stream=True, logprobs=2), stream=True),
    Case("cmpl_stream_echo", "/v1/completions", cmpl(stream=True, echo=True), stream=True),
    Case("cmpl_stream_n2", "/v1/completions", cmpl(stream=True, n=2, temperature=1.0), stream=True),
    Case("cmpl_stream_list", "/v1/completions", cmpl(stream=True, prompt=[ids(5), ids(7, 9)]), stream=True),
    Case("cmpl_stream_request_id", "/v1/completions", cmpl(stream=True), headers=RID, stream=True),
    # chat
    Case("chat", "/v1/chat/completions", chat()),
    Case("chat_n2", "/v1/chat/completions", chat(n=2, temperature=1.0)),
    Case("chat_max_completion_tokens", "/v1/chat/completions", {**chat(max_completion_tokens=3)}),
    Case("chat_logprobs", "/v1/chat/completions", chat(logprobs=True, top_logprobs=2)),
    Case("chat_stop", "/v1/chat/completions", chat(stop="zzzzqqq")),
    Case("chat_stream", "/v1/chat/completions", chat(stream=True), stream=True),
    Case(
        "chat_stream_usage",
        "/v1/chat/completions",
        chat(stream=True, stream_options={"include_usage": True}),
        stream=True,
    ),  # fmt: skip
    Case(
        "chat_stream_continuous",
        "/v1/chat/completions",
        chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
        stream=True,
    ),
    Case(
        "chat_stream_logprobs",
        "/v1/chat/completions",
        chat(stream=True, logprobs=True, top_logprobs=1),
        stream=True,
    ),  # fmt: skip
    Case("chat_stream_n2", "/v1/chat/completions", chat(stream=True, n=2, temperature=1.0), stream=True),
    Case("chat_request_id", "/v1/chat/completions", chat(), headers=RID),
    # errors
    Case("err_bad_json", "/v1/completions", raw=b'{"model": "tiny", "prompt": '),
    Case("err_body_list", "/v1/completions", [1, 2]),
    Case("err_unknown_model", "/v1/completions", cmpl(model="nope")),
    Case("err_unknown_model_chat", "/v1/chat/completions", chat(model="nope")),
    Case("err_no_prompt", "/v1/completions", {"model": M, "max_tokens": 3}),
    Case("err_no_messages", "/v1/chat/completions", {"model": M, "max_tokens": 3}),
    Case("err_max_tokens_0", "/v1/completions", cmpl(max_tokens=0)),
    Case("err_max_tokens_negative", "/v1/completions", cmpl(max_tokens=-1)),
    Case("err_max_tokens_over_context", "/v1/completions", cmpl(max_tokens=MAX_MODEL_LEN + 10)),
    Case("err_max_tokens_text", "/v1/completions", cmpl(max_tokens="three")),
    Case("err_n0", "/v1/completions", cmpl(n=0)),
    Case("err_temperature", "/v1/completions", cmpl(temperature=-1)),
    Case("err_top_p", "/v1/completions", cmpl(top_p=2)),
    Case("err_stream_options", "/v1/completions", cmpl(stream_options={"include_usage": True})),
    Case("err_stop_type", "/v1/completions", cmpl(stop=5)),
    Case("err_logprobs_too_many", "/v1/completions", cmpl(logprobs=50)),
    Case("err_empty_prompt", "/v1/completions", cmpl(prompt="")),
    Case("err_empty_token_list", "/v1/completions", cmpl(prompt=[])),
    Case("err_token_out_of_vocab", "/v1/completions", cmpl(prompt=[1, 2, 10**7])),
    Case("err_prompt_too_long", "/v1/completions", cmpl(prompt=ids(MAX_MODEL_LEN + 5))),
    Case("err_prompt_fills_context", "/v1/completions", cmpl(prompt=ids(MAX_MODEL_LEN))),
    Case("err_min_tokens", "/v1/completions", cmpl(min_tokens=9, max_tokens=3)),
    Case("err_request_id", "/v1/completions", cmpl(max_tokens=0), headers=RID),
    Case("err_chat_logprobs", "/v1/chat/completions", chat(top_logprobs=2)),
    # endpoints
    Case("version", "/version", method="GET"),
    Case("models", "/v1/models", method="GET"),
    Case("health", "/health", method="GET"),
    Case("ping", "/ping", method="GET"),
    Case("load", "/load", method="GET"),
    Case("kv_event_sources", "/kv_event_sources", method="GET"),
    Case("tokenize", "/tokenize", {"model": M, "prompt": "hello there"}),
    Case("tokenize_chat", "/tokenize", {"model": M, "messages": [{"role": "user", "content": "hi"}]}),
    Case("detokenize", "/detokenize", {"model": M, "tokens": ids(4)}),
    Case("render_completions", "/v1/completions/render", {"model": M, "prompt": "hello"}),
    Case("render_chat", "/v1/chat/completions/render", chat()),
    Case("not_found", "/nope", method="GET"),
    Case("not_found_request_id", "/nope", method="GET", headers=RID),
    Case("method_not_allowed", "/v1/completions", method="GET"),
    Case("metrics", "/metrics", method="GET"),
]

#: Known differences: case name ("*" for all) -> fnmatch patterns of difference paths. Mirrored in
#: docs/simengine.md ("Known differences from vLLM 0.32"); keep both in step.
ALLOWED: dict[str, tuple[str, ...]] = {}

#: Series only vLLM exports, by name prefix, and why simengine leaves them out (docs/simengine.md lists them).
VLLM_ONLY_SERIES = {
    "http_": "FastAPI instrumentator of vLLM's HTTP server (request counts, sizes and durations per handler)",
}
#: Series only simengine exports: its own namespace (transfer counters of the simulated P/D connectors).
SIM_ONLY_PREFIX = "simengine:"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("conformance")
    real, sim = start_engines(workdir)
    yield real, sim
    real.stop()
    sim.stop()


def test_kv_events_match_vllm_byte_for_byte(pair):
    """Repeated and evicting prompts: the same batches, in the same sequence numbers, with the same hashes."""
    real, sim = pair
    # Prompts of 2 tokens past whole blocks: with at most 4 output tokens no block fills with generated tokens,
    # so both engines cache exactly the same content.
    prompts = [ids(3 * BLOCK_SIZE + 2, 100), ids(3 * BLOCK_SIZE + 2, 100)]  # the second is a cache hit
    prompts += [ids(6 * BLOCK_SIZE + 2, 200 + 13 * k) for k in range(4)]  # 4 x 7 blocks > 23: evictions
    prompts += [ids(BLOCK_SIZE + 2, 100)]  # shares the first block with the first prompt
    assert sum(-(-len(p) // BLOCK_SIZE) for p in prompts[2:6]) > USABLE_BLOCKS
    for engine in pair:
        for prompt in prompts:
            reply = send(engine, Case("p", "/v1/completions", cmpl(prompt=prompt, max_tokens=2)))
            assert reply.status == 200, (engine.name, reply.body)
    want = wait_until(lambda: replay(real.replay, 0), 20, "vLLM's events")
    got = wait_until(lambda: replay(sim.replay, 0), 20, "simengine's events")
    assert [seq for seq, _ in got] == [seq for seq, _ in want]
    for (seq, a), (_, b) in zip(want, got, strict=True):
        assert len(a) == len(b) == 3 and a[2] == b[2], (seq, a, b)  # [ts, events, dp_rank]
        assert a[1] == b[1], f"batch {seq} differs:\nvLLM {a[1]}\nsim  {b[1]}"
    # replay from the middle and from the future
    middle = want[len(want) // 2][0]
    assert [s for s, _ in replay(sim.replay, middle)] == [s for s, _ in replay(real.replay, middle)]
    future = want[-1][0] + 100
    assert replay(sim.replay, future) == replay(real.replay, future) == []


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_same_answer_structure(pair, case):
    real, sim = pair
    a, b = send(real, case), send(sim, case)
    if case.name == "metrics":
        return  # compared by test_metric_names_and_labels
    diffs = unexplained(case.name, compare(case, a, b), ALLOWED)
    assert not diffs, "\n".join(f"{p}: vLLM {x} | simengine {y}" for p, x, y in diffs)


def series(text: str) -> set[tuple[str, tuple[str, ...]]]:
    """(sample name, label names) of every sample of a /metrics page."""
    return {
        (sample.name, tuple(sorted(sample.labels)))
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metric_names_and_labels(pair):
    real, sim = pair
    import httpx

    want, got = (series(httpx.get(e.url + "/metrics", timeout=10).text) for e in pair)
    missing = {s for s in want - got if not s[0].startswith(tuple(VLLM_ONLY_SERIES))}
    extra = {s for s in got - want if not s[0].startswith(SIM_ONLY_PREFIX)}
    assert not missing, f"vLLM series simengine lacks: {sorted(missing)}"
    assert not extra, f"simengine series vLLM lacks: {sorted(extra)}"


HASH_PROBE = """
import json, os, sys
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as k
blocks, salt = json.loads(sys.argv[1]), sys.argv[2]
out = {}
for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
    fn = get_hash_fn_by_name(algo)
    k.init_none_hash(fn)
    parent, chain = None, []
    for i, block in enumerate(blocks):
        parent = k.hash_block_tokens(fn, parent, block, (("cache_salt", salt),) if i == 0 else None)
        chain.append(k.maybe_convert_block_hash(parent))
    out[algo] = chain
print(json.dumps(out))
"""


def test_every_hash_algorithm_is_vllms():
    """The four `--prefix-caching-hash-algo` chains (with a salted first block) computed by vLLM 0.32's own
    functions and by simengine; the sha256 events above check the engine end to end."""
    import json
    import os
    import subprocess

    from simengine.block_hash import BlockHasher, to_event_hash
    from tests.vllm.conformance import VLLM_PYTHON

    blocks = [ids(BLOCK_SIZE, 7 * i) for i in range(5)]
    env = {**os.environ, "PYTHONHASHSEED": "1234"}
    run = subprocess.run([VLLM_PYTHON, "-c", HASH_PROBE, json.dumps(blocks), "tenant"], env=env,
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    want = json.loads(run.stdout.strip().splitlines()[-1])
    for algo, chain in want.items():
        hasher = BlockHasher(algo, seed="1234")
        parent, got = None, []
        for i, block in enumerate(blocks):
            parent = hasher.hash_block(parent, block, (("cache_salt", "tenant"),) if i == 0 else None)
            got.append(to_event_hash(parent))
        assert got == chain, algo


def test_a_chunk_carrying_two_tokens_has_the_shape_of_one_carrying_one():
    """A busy vLLM streams two tokens in one chunk: per-token lists compare by their entries' shapes, not length;
    an entry of another shape still differs."""
    chunk = {"choices": [{"logprobs": {"top_logprobs": [{"a": -1.0}, {"b": -2.0}], "tokens": ["a", "b"]}}]}
    one = {"choices": [{"logprobs": {"top_logprobs": [{"c": -1.0}], "tokens": ["c"]}}]}
    other = {"choices": [{"logprobs": {"top_logprobs": [{"c": "x"}], "tokens": ["c"]}}]}
    assert shape(chunk) == shape(one) and shape(other) != shape(one)
    token = {"token": "a", "logprob": -1.0, "bytes": [97]}
    token["top_logprobs"] = [dict(token)]
    chat_two = {
        "choices": [{"delta": {"content": "ab"}, "logprobs": {"content": [token, {**token, "token": "b"}]}}]
    }
    chat_one = {"choices": [{"delta": {"content": "c"}, "logprobs": {"content": [token]}}]}
    chat_bad = {"choices": [{"delta": {"content": "c"}, "logprobs": {"content": [{**token, "bytes": None}]}}]}
    assert shape(chat_two) == shape(chat_one) and shape(chat_bad) != shape(chat_one)
    # a token with empty text (empty bytes) among others is the same kind of entry (real vLLM, a CI run)
    alternative = {"token": "", "logprob": -1.0, "bytes": []}
    empty = {**alternative, "top_logprobs": [alternative]}
    chat_empty = {"choices": [{"message": {"content": "a"}, "logprobs": {"content": [token, empty]}}]}
    chat_plain = {"choices": [{"message": {"content": "a"}, "logprobs": {"content": [token]}}]}
    assert shape(chat_empty) == shape(chat_plain)
