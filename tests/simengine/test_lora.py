"""LoRA adapters in simengine: the registry and slot rule without sockets, block hashes and events of adapter
requests, and the HTTP surface (load/unload routes gated as vLLM gates them, `/v1/models`, the echo, metrics)
against an engine subprocess. The wire facts are vLLM 0.32's (simengine/lora.py; checked against CPU vLLM by
tests/vllm/test_lora_conformance.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from simengine.events import BlockStored, EventSink
from simengine.kv_cache_manager import KVCacheManager
from simengine.lora import LoraError, LoraRegistry, may_schedule, parse_lora_module
from simengine.request import Request, SamplingParams, Status
from simengine.scheduler import Scheduler
from tests.helpers import wait_until
from tests.simengine.test_scheduler import SAMPLER, req, run


def adapter_dir(root: Path, name: str, rank: int = 8) -> str:
    """A directory with what simengine reads of an adapter: `adapter_config.json` (PEFT's fields)."""
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16}))
    return str(path)


# -- registry ---------------------------------------------------------------------------------------------------


def test_load_checks_in_vllms_order(tmp_path):
    reg = LoraRegistry(["base"], max_loras=1, max_lora_rank=16)
    path = adapter_dir(tmp_path, "a")
    for name, p, status, words in (("", path, 400, "Both 'lora_name' and 'lora_path'"),
                                   ("x", "", 400, "Both"),
                                   ("base", path, 400, "conflicts with a served base model")):  # fmt: skip
        with pytest.raises(LoraError) as e:
            reg.check_load(name, p)
        assert e.value.status == status and words in e.value.message and e.value.kind == "InvalidUserInput"
    with pytest.raises(LoraError) as e:
        reg.read("gone", str(tmp_path / "nowhere"))
    assert e.value.status == 404 and e.value.kind == "NotFoundError"
    assert e.value.message == f"Loading lora gone failed: No adapter found for {tmp_path / 'nowhere'}"
    with pytest.raises(LoraError) as e:
        reg.read("big", adapter_dir(tmp_path, "big", rank=32))
    assert e.value.status == 500 and e.value.message == "LoRA rank 32 is greater than max_lora_rank 16."


def test_ids_in_load_order_kept_in_place_and_unload_forgets(tmp_path):
    reg = LoraRegistry(["base"], max_loras=1, max_lora_rank=16)
    a, b = adapter_dir(tmp_path, "a"), adapter_dir(tmp_path, "b")
    assert reg.add("a", a, 8).int_id == 1 and reg.add("b", b, 8).int_id == 2
    with pytest.raises(LoraError) as e:
        reg.check_load("a", a)
    assert e.value.status == 400 and "load_inplace" in e.value.message
    reg.check_load("a", b, load_inplace=True)
    assert reg.add("a", b, 8).int_id == 1 and reg.get("a").path == b
    assert reg.get("a").parent == "base"
    reg.remove("a")
    assert reg.get("a") is None and list(reg.adapters) == ["b"]
    with pytest.raises(LoraError) as e:
        reg.remove("a")
    assert (e.value.status, e.value.message) == (404, "The lora adapter 'a' cannot be found.")
    with pytest.raises(LoraError) as e:
        reg.remove("")
    assert e.value.status == 400


def test_cpu_cache_is_lru_over_max_cpu_loras(tmp_path):
    reg = LoraRegistry(["base"], max_loras=1, max_lora_rank=16, max_cpu_loras=2)
    a, b, c = (reg.add(n, adapter_dir(tmp_path, n), 8) for n in "abc")
    assert reg.cached_ids == [b.int_id, c.int_id]  # loading c evicted a
    assert reg.touch(a) is True  # read again: a load's cost
    assert reg.cached_ids == [c.int_id, a.int_id]
    assert reg.touch(a) is False and reg.touch(c) is False
    assert reg.cached_ids == [a.int_id, c.int_id]


def test_slot_rule_and_lora_modules_syntax(tmp_path):
    reg = LoraRegistry(["base"], max_loras=1, max_lora_rank=16)
    a, b = reg.add("a", adapter_dir(tmp_path, "a"), 8), reg.add("b", adapter_dir(tmp_path, "b"), 8)
    assert may_schedule(set(), a, 1) and may_schedule({a.int_id}, a, 1) and may_schedule({a.int_id}, None, 1)
    assert not may_schedule({a.int_id}, b, 1) and may_schedule({a.int_id}, b, 2)
    assert parse_lora_module("x=/p/x") == ("x", "/p/x", None)
    assert parse_lora_module('{"name": "y", "path": "/p/y", "base_model_name": "base"}') == (
        "y",
        "/p/y",
        "base",
    )
    with pytest.raises(ValueError, match="Invalid JSON"):
        parse_lora_module("{nope,")


# -- scheduler, hashes, events ------------------------------------------------------------------------------------


def test_max_loras_defers_a_second_adapter_not_the_base_model(tmp_path):
    reg = LoraRegistry(["base"], max_loras=1, max_lora_rank=16)
    a, b = reg.add("a", adapter_dir(tmp_path, "a"), 8), reg.add("b", adapter_dir(tmp_path, "b"), 8)
    s = Scheduler(KVCacheManager(64, 4, EventSink()), SAMPLER, 8, 64, "fcfs", max_loras=1)
    ra, rb, rbase = req(8, "ra", max_tokens=3), req(8, "rb", max_tokens=3), req(8, "base", max_tokens=3)
    ra.lora, rb.lora = a, b
    for r in (ra, rb, rbase):
        s.add_request(r)
    first = s.schedule()
    assert [r for r, _ in first.scheduled] == [ra, rbase]
    assert list(s.waiting) == [rb] and s.num_deferred == 1
    s.update(first)
    run(s)
    assert all(r.status is Status.FINISHED_LENGTH for r in (ra, rb, rbase))


def test_adapter_requests_hash_apart_and_events_name_the_adapter(tmp_path):
    reg = LoraRegistry(["base"], max_loras=2, max_lora_rank=16)
    a = reg.add("a", adapter_dir(tmp_path, "a"), 8)
    b_same_name_elsewhere = reg.add("a2", adapter_dir(tmp_path, "a2"), 8)
    sink = EventSink()
    kv = KVCacheManager(64, 4, sink)
    prompt = list(range(100, 112))

    def hashes(lora, salt=None):
        r = Request(
            f"r{time.monotonic_ns()}", list(prompt), SamplingParams(1), 0.0, cache_salt=salt, lora=lora
        )
        kv.update_hashes(r)
        return r.block_hashes

    base, with_a = hashes(None), hashes(a)
    assert len(base) == 3 and len(with_a) == 3
    assert not set(base) & set(with_a)  # every block differs, not only the first
    assert hashes(a) == with_a and not set(hashes(b_same_name_elsewhere)) & set(with_a)
    assert not set(hashes(a, salt="s")) & set(with_a)  # the salt keys the first block, the chain the rest

    s = Scheduler(kv, SAMPLER, 8, 64, "fcfs", max_loras=2)
    r = Request("ev", list(prompt), SamplingParams(1, ignore_eos=True), 0.0, cache_salt="s", lora=a)
    s.add_request(r)
    run(s)
    stored = [e for e in sink.drain() if isinstance(e, BlockStored)]
    assert stored and stored[0].lora_id == a.int_id and stored[0].lora_name == "a"
    assert stored[0].extra_keys[0] == ("a", "s") and stored[0].extra_keys[1] == ("a",)


# -- HTTP -------------------------------------------------------------------------------------------------------

RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def lora_lines(url: str) -> list[str]:
    return [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith("vllm:lora_")]


def test_routes_exist_only_with_the_variable(engines, tmp_path):
    off = engines("--enable-lora", "--speedup", "1000", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    r = httpx.post(off.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
    assert (r.status_code, r.json()) == (404, {"detail": "Not Found"})
    assert lora_lines(off.url) == []  # no sample before the first stats update, as vLLM
    plain = engines("--speedup", "1000", env=RUNTIME)
    r = httpx.post(plain.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
    assert r.status_code == 500 and "--enable-lora" in r.json()["error"]["message"]
    assert "vllm:lora_requests_info" not in httpx.get(plain.url + "/metrics").text


def test_load_list_serve_echo_unload(engines, tmp_path):
    a, b = adapter_dir(tmp_path, "a"), adapter_dir(tmp_path, "b")
    e = engines("--served-model-name", "base", "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
                "--lora-modules", f"static-a={a}", "--speedup", "10", "--lora-load-ms", "1000",
                env=RUNTIME)  # fmt: skip
    models = httpx.get(e.url + "/v1/models").json()["data"]
    assert [(m["id"], m["parent"], m["root"]) for m in models] == [
        ("base", None, "sim-8b"),
        ("static-a", "base", a),
    ]
    assert models[1]["max_model_len"] is None and models[1]["owned_by"] == "vllm"

    start = time.monotonic()
    r = httpx.post(e.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": b}, timeout=10)
    took = time.monotonic() - start
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' added successfully.")
    assert took >= 0.1  # --lora-load-ms 1000 / --speedup 10
    for body, status, words in (({"lora_name": "b", "lora_path": b}, 400, "already been loaded"),
                                ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, 404, "No adapter found"),
                                ({"lora_name": "base", "lora_path": b}, 400, "conflicts"),
                                ({"lora_name": "x"}, 400, "Field required")):  # fmt: skip
        r = httpx.post(e.url + "/v1/load_lora_adapter", json=body, timeout=10)
        assert r.status_code == status and words in r.json()["error"]["message"], r.text
    r = httpx.post(
        e.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": b, "load_inplace": True}
    )
    assert r.status_code == 200
    assert [m["id"] for m in httpx.get(e.url + "/v1/models").json()["data"]] == ["base", "static-a", "b"]

    for name in ("b", "static-a"):
        r = httpx.post(
            e.url + "/v1/completions", json={"model": name, "prompt": "hello there", "max_tokens": 2}
        )
        assert r.status_code == 200 and r.json()["model"] == name
    chat = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(e.url + "/v1/chat/completions", json=chat).json()["model"] == "b"
    wait_until(
        lambda: any('running_lora_adapters="b"' in line for line in lora_lines(e.url)), 5, "b's series"
    )
    line = next(line for line in lora_lines(e.url) if 'running_lora_adapters="b"' in line)
    assert line.startswith(
        'vllm:lora_requests_info{max_lora="1",running_lora_adapters="b",waiting_lora_adapters="b"}'
    )
    assert abs(float(line.rsplit(" ", 1)[1]) - time.time()) < 60  # set to the wall clock

    r = httpx.post(e.url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'b' removed successfully.")
    r = httpx.post(e.url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = httpx.post(e.url + "/v1/completions", json={"model": "b", "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "The model `b` does not exist. Valid aliases: base.",
                                 "type": "NotFoundError", "param": "model", "code": 404}  # fmt: skip


def test_bad_lora_modules_stop_the_start(engines, tmp_path):
    e = engines("--enable-lora", "--lora-modules", f"x={tmp_path / 'none'}", wait=False)
    assert e.proc.wait(20) == 2
    assert "No adapter found" in e.proc.stderr.read().decode()
    e2 = engines("--lora-modules", f"x={tmp_path}", wait=False)
    assert e2.proc.wait(20) == 2 and "--enable-lora" in e2.proc.stderr.read().decode()
