"""vLLM's OpenAI HTTP surface, against a real engine subprocess."""

import json
import subprocess
import sys

from tests.helpers import ROOT
from tests.simengine.conftest import EngineProc


def test_health_ping_models_version(engine):
    assert engine.get("/health")[0] == 200
    assert engine.get("/ping")[0] == 200
    models = json.loads(engine.get("/v1/models")[1])
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["sim", "alias"]
    assert models["data"][0]["owned_by"] == "vllm" and models["data"][0]["max_model_len"] > 0
    assert "version" in json.loads(engine.get("/version")[1])


def test_completion_shape_and_request_id(engine):
    status, body = engine.post("/v1/completions", {"model": "sim", "prompt": "hello world", "max_tokens": 5},
                               {"X-Request-Id": "abc123"})  # fmt: skip
    assert status == 200
    assert list(body) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                          "usage", "kv_transfer_params", "ec_transfer_params", "metrics"]  # fmt: skip
    assert body["id"] == "cmpl-abc123" and body["object"] == "text_completion" and body["model"] == "sim"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None and choice["index"] == 0
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] == 2
    assert body["usage"]["total_tokens"] == 7 and body["kv_transfer_params"] is None


def test_output_is_deterministic_and_max_tokens_truncates(engine):
    def text(**kw):
        return engine.post("/v1/completions", {"prompt": "the same prompt", **kw})[1]["choices"][0]["text"]

    long = text(max_tokens=12, ignore_eos=True)
    assert long == text(max_tokens=12, ignore_eos=True)
    assert long.startswith(text(max_tokens=4))
    assert text(max_tokens=12, ignore_eos=True, temperature=0.7, seed=1) != long


def test_prompt_forms_and_n(engine):
    _, body = engine.post(
        "/v1/completions", {"prompt": ["one", "two"], "max_tokens": 2, "n": 2, "temperature": 1}
    )
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"] != body["choices"][1]["text"]
    assert body["usage"]["completion_tokens"] == 8
    _, by_ids = engine.post("/v1/completions", {"prompt": [[300, 301], [302]], "max_tokens": 2})
    assert len(by_ids["choices"]) == 2 and by_ids["usage"]["prompt_tokens"] == 3


def test_chat_completion(engine):
    status, body = engine.post(
        "/v1/chat/completions",
        {"model": "alias", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3},
        {"X-Request-Id": "c1"},
    )
    assert status == 200 and body["id"] == "chatcmpl-c1" and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] and body["usage"]["completion_tokens"] == 3
    assert "kv_transfer_params" in body


def test_streaming_completion_with_usage(engine):
    events = engine.stream("/v1/completions", {"prompt": "stream me", "max_tokens": 6, "ignore_eos": True,
                                               "stream_options": {"include_usage": True}})  # fmt: skip
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    tokens = chunks[:-1]
    assert len(tokens) == 6 and tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in tokens[:-1])
    full = engine.post("/v1/completions", {"prompt": "stream me", "max_tokens": 6, "ignore_eos": True})[1]
    assert "".join(c["choices"][0]["text"] for c in tokens) == full["choices"][0]["text"]


def test_streaming_chat(engine):
    events = engine.stream(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    )
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks) and events[-1] == "[DONE]"


def test_stop_strings(engine):
    base = engine.post("/v1/completions", {"prompt": "stop test", "max_tokens": 10, "ignore_eos": True})[1]
    words = base["choices"][0]["text"].split(" ")
    stop = " " + words[3]
    _, body = engine.post("/v1/completions", {"prompt": "stop test", "max_tokens": 10, "ignore_eos": True,
                                              "stop": [stop]})  # fmt: skip
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == base["choices"][0]["text"].split(stop)[0]
    events = engine.stream("/v1/completions", {"prompt": "stop test", "max_tokens": 10, "ignore_eos": True,
                                                 "stop": stop})  # fmt: skip
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == choice["text"]


def test_min_tokens_and_eos(engine):
    _, natural = engine.post("/v1/completions", {"prompt": "eos check", "max_tokens": 2000})
    n = natural["usage"]["completion_tokens"]
    assert natural["choices"][0]["finish_reason"] == "stop" and n < 2000
    _, longer = engine.post(
        "/v1/completions", {"prompt": "eos check", "max_tokens": 2000, "min_tokens": n + 5}
    )
    assert longer["usage"]["completion_tokens"] == n + 6


def test_errors(engine):
    status, body = engine.post("/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and body["error"]["type"] == "NotFoundError" and "nope" in body["error"]["message"]
    for bad in ({"prompt": "x", "max_tokens": 0}, {"prompt": 3}, {"prompt": "x", "n": 0},
                {"prompt": "x", "stream_options": {"include_usage": True}}, {"prompt": "x", "max_tokens": 10**9},
                {"prompt": "x", "temperature": -1}, {"prompt": "x", "min_tokens": 5, "max_tokens": 2}):  # fmt: skip
        status, body = engine.post("/v1/completions", bad)
        assert status == 400, bad
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == 400
    status, body = engine.post("/v1/chat/completions", {"messages": "hi"})
    assert status == 400
    import urllib.error
    import urllib.request

    req = urllib.request.Request(engine.url + "/v1/completions", data=b"{not json", method="POST")
    try:
        urllib.request.urlopen(req)
        raise AssertionError("expected 400")
    except urllib.error.HTTPError as e:
        assert e.code == 400 and "error" in json.loads(e.read())


def test_tokenize_detokenize_render(engine):
    _, tok = engine.post("/tokenize", {"prompt": "hello world"})
    assert list(tok) == ["count", "max_model_len", "tokens", "token_strs"] and tok["count"] == 2
    _, de = engine.post("/detokenize", {"tokens": tok["tokens"]})
    assert de == {"prompt": "hello world"}
    _, chat_tok = engine.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    # vLLM 0.32 serves the render endpoints only with --enable-scale-out
    status, denied = engine.post("/v1/completions/render", {"prompt": "a"})
    assert status == 403 and denied["error"]["type"] == "PermissionDeniedError"


def test_render_with_scale_out(engines):
    engine = engines("--speedup", "1000", "--enable-scale-out")
    _, tok = engine.post("/tokenize", {"prompt": "hello world"})
    _, chat_tok = engine.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    _, rendered = engine.post(
        "/v1/chat/completions/render", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    )
    assert rendered["token_ids"] == chat_tok["tokens"] and rendered["sampling_params"]["max_tokens"] == 3
    # the keys vLLM 0.32 dumps for GenerateRequest(request_id, token_ids, sampling_params=SamplingParams(max_tokens=3),
    # model) (vllm.entrypoints.scale_out.token_in_token_out.protocol, model_dump(mode="json"))
    assert list(rendered) == ["request_id", "token_ids", "token_offsets", "features", "content_parts",
                              "sampling_params", "model", "reasoning_ended", "reasoning_parser_kwargs",
                              "return_token_ids", "output_mode", "stream", "stream_options", "cache_salt", "priority",
                              "kv_transfer_params", "ec_transfer_params"]  # fmt: skip
    assert rendered["sampling_params"] == {"stop": [], "stop_token_ids": [], "max_tokens": 3, "bad_words": [],
                                           "skip_reading_prefix_cache": False}  # fmt: skip
    _, rc = engine.post("/v1/completions/render", {"prompt": ["hello world", "bye"]}, {"X-Request-Id": "r"})
    assert [r["request_id"] for r in rc] == ["r-0", "r-1"] and rc[0]["token_ids"] == tok["tokens"]
    assert engine.post("/v1/completions/render", {"model": "x", "prompt": "a"})[0] == 404


def test_metrics_names_and_labels(engine):
    engine.post("/v1/completions", {"prompt": "metrics please", "max_tokens": 3})
    _, raw = engine.get("/metrics")
    text = raw.decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 'vllm:prompt_tokens_by_source_total{engine="0",model_name="sim",source="local_compute"}',
                 'vllm:request_success_total{engine="0",finished_reason="length",model_name="sim"}'):  # fmt: skip
        assert name in text, name
    assert 'model_name="sim"' in text and 'engine="0"' in text
    assert engine.metric("vllm:generation_tokens_total") >= 3


def test_prefix_cache_hits_counted(engine):
    prompt = "cache me " * 40
    before = engine.metric("vllm:prefix_cache_hits_total")
    engine.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    engine.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert engine.metric("vllm:prefix_cache_hits_total") - before >= 64


def test_help_lists_every_option():
    out = subprocess.run(
        [sys.executable, "-m", "simengine", "--help"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0
    for opt in ("--host", "--port", "--served-model-name", "--block-size", "--max-num-seqs",
                "--max-num-batched-tokens", "--enable-prefix-caching", "--no-enable-prefix-caching",
                "--kv-events-config", "--kv-transfer-config", "--data-parallel-rank", "--tokenizer", "--speedup",
                "--profile", "--fault-crash-after", "--fault-hang", "--fault-latency-ms", "--fault-error-rate",
                "--fault-drop-callbacks", "--fault-duplicate-callbacks", "--fault-event-gap-every", "--npu-blocks",
                "--cpu-blocks", "--disk-blocks", "--offload", "--kv-events-legacy-format"):  # fmt: skip
        assert opt in out.stdout, opt


def test_bad_config_is_one_line_error():
    out = subprocess.run([sys.executable, "-m", "simengine", "--kv-transfer-config", "{bad"], cwd=ROOT,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "--kv-transfer-config" in out.stderr
    out = subprocess.run([sys.executable, "-m", "simengine", "--kv-transfer-config", '{"kv_connector":"X","kv_role":"kv_both"}'],
                         cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "unsupported kv_connector" in out.stderr


def test_sigterm_exits_cleanly(engines):
    e = engines("--model", "m1")
    assert e.stop() == 0


def test_prefix_caching_can_be_disabled(engines):
    e = engines("--speedup", "1000", "--no-enable-prefix-caching")
    for _ in range(2):
        e.post("/v1/completions", {"prompt": "cache me " * 40, "max_tokens": 1})
    assert e.metric("vllm:prefix_cache_hits_total") == 0
    assert e.metric("vllm:prompt_tokens_total") > 0


def test_data_parallel_rank_labels_metrics(engines):
    e = engines(
        "--speedup", "1000", "--data-parallel-rank", "1", "--data-parallel-size", "2", "--model", "dp"
    )
    e.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
    _, raw = e.get("/metrics")
    assert 'vllm:generation_tokens_total{engine="1",model_name="dp"} 1.0' in raw.decode()


def test_priority_field_needs_the_priority_scheduling_policy(engine, engines):
    body = {"model": "sim", "prompt": "hello", "max_tokens": 2, "priority": 1}
    status, reply = engine.post("/v1/completions", body)
    assert (
        status == 400
        and reply["error"]["message"] == "Got priority 1 but Priority scheduling is not enabled."
    )
    assert engine.post("/v1/completions", {**body, "priority": 0})[0] == 200
    prio = engines("--speedup", "1000", "--served-model-name", "sim", "--scheduling-policy", "priority")
    for value in (-1, 0, 1):
        status, reply = prio.post("/v1/completions", {**body, "priority": value})
        assert status == 200 and reply["usage"]["completion_tokens"] == 2


def test_prompt_tokens_details_report_the_cached_prompt_tokens_as_vllm():
    """`--enable-prompt-tokens-details`: `usage.prompt_tokens_details.cached_tokens` is what the prefix cache held
    of the prompt (whole blocks); without the flag the details are null (and absent from a stream's usage)."""
    prompt = {"model": "sim", "prompt": " ".join(f"w{i}" for i in range(70)), "max_tokens": 2}
    streamed = {**prompt, "stream_options": {"include_usage": True}}
    engine = EngineProc("--speedup", "1000", "--served-model-name", "sim", "--enable-prompt-tokens-details")
    try:
        first = engine.post("/v1/completions", prompt)[1]["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        again = engine.post("/v1/completions", prompt)[1]["usage"]
        cached = again["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < again["prompt_tokens"] and cached % 16 == 0
        usage = json.loads(engine.stream("/v1/completions", streamed)[-2])["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": cached}
    finally:
        engine.stop()
    plain = EngineProc("--speedup", "1000", "--served-model-name", "sim")
    try:
        assert plain.post("/v1/completions", prompt)[1]["usage"]["prompt_tokens_details"] is None
        assert (
            "prompt_tokens_details" not in json.loads(plain.stream("/v1/completions", streamed)[-2])["usage"]
        )
    finally:
        plain.stop()
