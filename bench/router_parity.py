"""Peer routers' cache-aware modes in front of real vLLM and in front of simengine: the same short replay, the same
hits and errors? (issue 16: simengine must be indistinguishable from vLLM 0.32 to the routers too)

    TANDEM_VLLM_PYTHON=.venv-vllm/bin/python TANDEM_TINY_MODEL=build/tiny-llama python -m bench.router_parity

Two engines of each kind (tiny model, block size 32, same limits as the conformance suite), then for each router
setup (sglang-router cache_aware; vllm-router cache_aware in front of engines as started by default, whose render
endpoints answer 403, and in front of engines started with --enable-scale-out, whose render endpoints give the
router token ids) a replay of prompt groups sharing long prefixes, sequential so the routing is deterministic.
Reported per backend: answers by status, requests per engine, prefix-cache hit tokens per engine (from each
engine's /metrics). Needs the `bench` extra (the routers) and the real-vLLM venv of `make test-vllm`.

vllm-router's kv_aware policy is not compared: it subscribes to tcp:// KV event endpoints only, which vLLM (and
simengine) bind only for wildcard addresses (`tcp://*:P`), i.e. on every interface; these checks stay on loopback.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import httpx

from bench.harness import free_ports, wait_until
from tests.vllm.conformance import BLOCK_SIZE, MAX_MODEL_LEN, MODEL, MODEL_NAME, USABLE_BLOCKS, VLLM_PYTHON

WORDS = ("cache", "router", "prefill", "decode", "engine", "block", "token", "prefix", "event", "replay")


def prompts(groups: int, per_group: int) -> list[str]:
    """`groups` shared prefixes of ~200 tokens, each followed by `per_group` distinct questions, interleaved."""
    out = []
    for q in range(per_group):
        for g in range(groups):
            prefix = " ".join(f"{WORDS[(g * 3 + i) % len(WORDS)]}{g}{i % 7}" for i in range(70))
            out.append(f"{prefix} question {q} for group {g}?")
    return out


def start_engine(
    kind: str, workdir: Path, name: str, port: int, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str, str, str]:
    pub, replay = f"ipc://{workdir}/{name}.pub", f"ipc://{workdir}/{name}.replay"
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
                         "replay_endpoint": replay, "topic": ""})  # fmt: skip
    common = ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--block-size",
              str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
              "--kv-events-config", events, *extra]  # fmt: skip
    if kind == "vllm":
        argv = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL, "--enforce-eager",
                "--dtype", "float32", "--num-gpu-blocks-override", str(4 * USABLE_BLOCKS + 1)]  # fmt: skip
    else:
        argv = [sys.executable, "-m", "simengine", MODEL_NAME, "--tokenizer", MODEL, "--speedup", "20",
                "--npu-blocks", str(4 * USABLE_BLOCKS)]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # fmt: skip
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([*argv, *common], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    return proc, f"http://127.0.0.1:{port}", pub, replay


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


SCALE_OUT = "vllm-router cache_aware, engines with --enable-scale-out"


def router_argv(setup: str, port: int, prom_port: int, workers: list[tuple[str, str, str]]) -> list[str]:
    urls = [w[0] for w in workers]
    prom = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom_port)]
    if setup == "sglang-router cache_aware":
        return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                *prom, "--policy", "cache_aware", "--worker-urls", *urls]  # fmt: skip
    bin_ = str(Path(sys.executable).parent / "vllm-router")
    return [
        bin_,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *prom,
        "--worker-urls",
        *urls,
        "--policy",
        "cache_aware",
    ]


def replay(
    setup: str, workers: list[tuple[str, str, str]], texts: list[str], workdir: Path, tag: str
) -> dict:
    port, prom_port = free_ports(2)  # one call: the router's two ports cannot come out the same
    log = open(workdir / f"router-{tag}.log", "wb")  # noqa: SIM115
    router = subprocess.Popen(
        router_argv(setup, port, prom_port, workers), stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            if router.poll() is not None:
                raise RuntimeError(f"{setup} exited: {(workdir / f'router-{tag}.log').read_text()[-2000:]}")
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 60, f"{setup} ready", 0.2)
        before = {w[0]: (metric(w[0], "vllm:prefix_cache_hits_total"), metric(w[0], "vllm:request_success_total"))
                  for w in workers}  # fmt: skip
        statuses: Counter[int] = Counter()
        for text in texts:
            body = {"model": MODEL_NAME, "prompt": text, "max_tokens": 3, "ignore_eos": True}
            try:
                statuses[httpx.post(url + "/v1/completions", json=body, timeout=120).status_code] += 1
            except httpx.HTTPError:
                statuses[0] += 1
        after = {w[0]: (metric(w[0], "vllm:prefix_cache_hits_total"), metric(w[0], "vllm:request_success_total"))
                 for w in workers}  # fmt: skip
    finally:
        router.terminate()
        router.wait(10)
    hits = [int(after[w][0] - before[w][0]) for w, _, _ in workers]
    served = [int(after[w][1] - before[w][1]) for w, _, _ in workers]
    return {"statuses": dict(statuses), "requests_per_engine": sorted(served), "hit_tokens_per_engine": sorted(hits),
            "hit_tokens": sum(hits)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workdir", default=None, help="where engine and router logs go (default: a new temp dir)"
    )
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--per-group", type=int, default=5)
    p.add_argument(
        "--setups", nargs="+", default=["sglang-router cache_aware", "vllm-router cache_aware", SCALE_OUT]
    )
    args = p.parse_args(argv)
    if not (VLLM_PYTHON and MODEL):
        p.error("set TANDEM_VLLM_PYTHON and TANDEM_TINY_MODEL (make test-vllm builds both)")
    texts = prompts(args.groups, args.per_group)
    results: dict[str, dict[str, dict]] = {}
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="router-parity-"))  # kept: engine and router logs
    workdir.mkdir(parents=True, exist_ok=True)
    for n, setup in enumerate(args.setups):
        for kind in ("vllm", "sim"):  # fresh engines per setup: every replay starts from empty caches
            extra = ("--enable-scale-out",) if setup == SCALE_OUT else ()
            ports = free_ports(2)  # one call: the two engines' ports differ
            started = [start_engine(kind, workdir, f"{kind}{i}-{n}", ports[i], extra) for i in (0, 1)]
            try:
                for _, url, _, _ in started:
                    wait_until(lambda url=url: healthy(url), 900, f"{kind} engine {url}", 0.5)
                workers = [(url, pub, rep) for _, url, pub, rep in started]
                results.setdefault(setup, {})[kind] = replay(setup, workers, texts, workdir, f"{kind}{n}")
                print(setup, kind, json.dumps(results[setup][kind]), flush=True)
            finally:
                for proc, *_ in started:
                    proc.terminate()
                for proc, *_ in started:
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
    same = all(r["vllm"] == r["sim"] for r in results.values())
    print(json.dumps(results, indent=1))
    print("same behaviour in front of vLLM and simengine:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
