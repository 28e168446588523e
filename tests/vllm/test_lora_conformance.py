"""LoRA in simengine against real vLLM 0.32 (CPU, tiny model, a tiny random adapter made locally by
scripts/build_tiny_lora.py: PEFT's format written with torch and safetensors, no peft): the runtime load and
unload answers and errors, `/v1/models` with adapters, a completion and a chat naming an adapter (the echo), the
404 of an unloaded one, `vllm:lora_requests_info`, and the KV events of an adapter's blocks byte for byte (vLLM
keys them by the adapter's name and path). One scenario, the same steps sent to both engines in order."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from tests.helpers import wait_until
from tests.vllm.conformance import (
    BLOCK_SIZE,
    MODEL,
    MODEL_NAME,
    ROOT,
    VLLM_PYTHON,
    Case,
    compare,
    replay,
    send,
    start_engines,
    unexplained,
)
from tests.vllm.test_conformance import cmpl, ids, series

M = MODEL_NAME
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
#: Known differences (docs/simengine.md, "Known differences from vLLM 0.32"): vLLM answers a successful load or
#: unload with a text body and no Content-Type; aiohttp, which simengine runs on, always names one for a body.
ALLOWED = {
    "load_ok": ("header.content-type",),
    "load_inplace": ("header.content-type",),
    "unload_ok": ("header.content-type",),
}


@pytest.fixture(scope="module")
def lora_pair(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lora")
    adapters = {}
    for name, rank in (("a", 8), ("b", 8), ("big", 16)):
        path = workdir / f"lora-{name}"
        subprocess.run([VLLM_PYTHON, str(ROOT / "scripts/build_tiny_lora.py"), MODEL, str(path), str(rank)],
                       check=True, timeout=120)  # fmt: skip
        adapters[name] = str(path)
    extra = (
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"static={adapters['b']}",
    )
    real, sim = start_engines(workdir, extra=extra, environ={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    yield real, sim, adapters
    real.stop()
    sim.stop()


def same(real, sim, case: Case, exact_body: bool = False):
    a, b = send(real, case), send(sim, case)
    diffs = unexplained(case.name, compare(case, a, b), ALLOWED)
    assert not diffs, case.name + ":\n" + "\n".join(f"{p}: vLLM {x} | simengine {y}" for p, x, y in diffs)
    if exact_body:
        assert a.body == b.body, (case.name, a.body, b.body)
    return a, b


def test_lora_matches_vllm(lora_pair):
    real, sim, adapters = lora_pair
    a_path = adapters["a"]
    # loading: success, then each refusal, in vLLM's order of checks
    same(real, sim, Case("load_ok", LOAD, {"lora_name": "ad-a", "lora_path": a_path}), exact_body=True)
    same(real, sim, Case("load_dup", LOAD, {"lora_name": "ad-a", "lora_path": a_path}), exact_body=True)
    same(real, sim, Case("load_inplace", LOAD, {"lora_name": "ad-a", "lora_path": a_path, "load_inplace": True}),
         exact_body=True)  # fmt: skip
    bad = {"lora_name": "bad", "lora_path": str(ROOT / "build" / "no-such-adapter")}
    # Status, type and shape only: real vLLM named the path in one run and wrote a literal `<path>` in another
    # (a fresh clone under /tmp); simengine names it.
    same(real, sim, Case("load_bad_path", LOAD, bad))
    same(real, sim, Case("load_base_name", LOAD, {"lora_name": M, "lora_path": a_path}), exact_body=True)
    same(real, sim, Case("load_empty_name", LOAD, {"lora_name": "", "lora_path": a_path}), exact_body=True)
    same(real, sim, Case("load_missing_path", LOAD, {"lora_name": "x"}), exact_body=True)
    # a rank above --max-lora-rank: refused by the engine (500); vLLM's message carries its engine-core wrapping
    same(real, sim, Case("load_rank_too_big", LOAD, {"lora_name": "big", "lora_path": adapters["big"]}))

    a, b = same(real, sim, Case("models", "/v1/models", method="GET"))
    listing = [[(m["id"], m["parent"], m["root"], m["max_model_len"] is None) for m in r.body["data"][1:]]
               for r in (a, b)]  # fmt: skip
    assert listing[0] == listing[1] == [("static", M, adapters["b"], True), ("ad-a", M, a_path, True)]

    # serving an adapter: the answer names it; its blocks are keyed by it
    prompt = ids(2 * BLOCK_SIZE + 2, 300)
    first_seq = {}
    for engine in (real, sim):
        before = replay(engine.replay, 0)
        first_seq[engine.name] = before[-1][0] + 1 if before else 0
    a, b = same(
        real, sim, Case("cmpl_adapter", "/v1/completions", cmpl(model="ad-a", prompt=prompt, max_tokens=6))
    )
    assert a.body["model"] == b.body["model"] == "ad-a"
    chat = {"model": "static", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    a, b = same(real, sim, Case("chat_adapter", "/v1/chat/completions", chat))
    assert a.body["model"] == b.body["model"] == "static"

    def adapter_blocks(engine):
        events = [ev for _, batch in replay(engine.replay, first_seq[engine.name]) for ev in batch[1]]
        return [ev for ev in events if isinstance(ev, dict) and ev.get("lora_name") == "ad-a"]

    want = wait_until(lambda: adapter_blocks(real), 20, "vLLM's events of the adapter's blocks")
    got = wait_until(lambda: adapter_blocks(sim), 20, "simengine's events of the adapter's blocks")
    assert want == got, f"vLLM {want}\nsim  {got}"
    assert want[0]["lora_id"] and want[0]["extra_keys"][0] == ["ad-a"]

    # metrics: the same series, and one naming the adapter that ran
    pages = [httpx.get(e.url + "/metrics", timeout=10).text for e in (real, sim)]
    lora = [{s for s in series(page) if s[0].startswith("vllm:lora")} for page in pages]
    assert lora[0] == lora[1] == {("vllm:lora_requests_info", ("max_lora", "running_lora_adapters",
                                                                "waiting_lora_adapters"))}  # fmt: skip
    for page in pages:
        assert (
            'vllm:lora_requests_info{max_lora="1",running_lora_adapters="ad-a",waiting_lora_adapters="ad-a"}'
            in page
        )

    # unloading: the name is gone for the API
    same(real, sim, Case("unload_ok", UNLOAD, {"lora_name": "ad-a"}), exact_body=True)
    same(real, sim, Case("unload_again", UNLOAD, {"lora_name": "ad-a"}), exact_body=True)
    same(real, sim, Case("unload_empty", UNLOAD, {"lora_name": ""}), exact_body=True)
    same(real, sim, Case("unload_missing_field", UNLOAD, {}), exact_body=True)
    same(real, sim, Case("cmpl_unloaded", "/v1/completions", cmpl(model="ad-a")), exact_body=True)
    a, b = same(real, sim, Case("models_after", "/v1/models", method="GET"))
    assert [m["id"] for m in a.body["data"]] == [m["id"] for m in b.body["data"]] == [M, "static"]
