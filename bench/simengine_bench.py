"""Simulated-engine benchmark: streamed tokens/s of one engine process at 256 concurrent streams (high speedup,
CPU-bound), and the timing model's TTFT / ITL measured at speedup 1 against what its profile predicts.

    python -m bench.simengine_bench [--streams 256] [--tokens 256] [--seconds 10] [--seed 0]

The load generator is a raw-socket HTTP/1.1 client in a separate process (so the engine gets its own core); it
counts SSE events, not parsed JSON, to stay cheaper than the engine it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time

from bench.harness import TimedOut, free_ports, http_ok, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_engine(port: int, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "simengine", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: http_ok(f"http://127.0.0.1:{port}/health", 0.5), 10, "the engine's /health", 0.05)
    except TimedOut:
        proc.kill()
        raise RuntimeError("engine did not start") from None
    return proc


def _request(port: int, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


async def _stream_once(port: int, body: dict, on_event=None) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(port, body))
    events = 0
    tail = b""
    try:
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                break
            data = tail + chunk
            n = data.count(b'"text":')
            if n and on_event is not None:
                on_event(n)
            events += n
            tail = data[-8:]
            if b"data: [DONE]" in data:
                break
    finally:
        writer.close()
    return events


def _load_client(port: int, streams: int, tokens: int, seconds: float, seed: int, out) -> None:
    import uvloop

    async def main() -> None:
        rng = random.Random(seed)
        counted = 0
        stop_at = time.perf_counter() + seconds

        def count(n: int) -> None:
            nonlocal counted
            counted += n

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "prompt")) for _ in range(64))
                body = {"prompt": words, "max_tokens": tokens, "ignore_eos": True, "stream": True}
                await _stream_once(port, body, count)

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(streams)]
        await asyncio.sleep(1.0)  # warm-up
        c0, w0 = counted, time.perf_counter()
        await asyncio.sleep(seconds - 1.0)
        c1, w1 = counted, time.perf_counter()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        out.put(((c1 - c0) / (w1 - w0), time.perf_counter() - t0))

    uvloop.run(main())


def throughput(streams: int, tokens: int, seconds: float, seed: int) -> tuple[float, float]:
    (port,) = free_ports(1)
    proc = start_engine(port, "--speedup", "10000", "--max-num-seqs", str(streams), "--npu-blocks", "65536")
    try:
        q: mp.Queue = mp.Queue()
        child = mp.Process(target=_load_client, args=(port, streams, tokens, seconds, seed, q))
        t_cpu0 = _cpu_seconds(proc.pid)
        child.start()
        rate, _ = q.get(timeout=seconds + 60)
        child.join()
        cpu = (_cpu_seconds(proc.pid) - t_cpu0) / seconds
        return rate, cpu
    finally:
        proc.terminate()
        proc.wait(5)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _latency(port: int, prompt_tokens: int, out_tokens: int, runs: int) -> tuple[float, float]:
    ttfts, itls = [], []
    for r in range(runs):
        ids = [
            300 + (r * 7919 + i * 31) % 3000 for i in range(prompt_tokens)
        ]  # distinct prompts: no cache hits
        body = {"prompt": ids, "max_tokens": out_tokens, "ignore_eos": True, "stream": True}
        stamps: list[float] = []
        t0 = time.perf_counter()
        await _stream_once(port, body, lambda n, s=stamps: s.extend([time.perf_counter()] * n))
        ttfts.append(stamps[0] - t0)
        itls.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return sum(ttfts) / runs, sum(itls) / runs


def timing(
    profile_name: str, prompt_tokens: int, out_tokens: int, runs: int
) -> tuple[float, float, float, float]:
    sys.path.insert(0, ROOT)
    from simengine.profiles import PROFILES

    profile = PROFILES[profile_name]
    (port,) = free_ports(1)
    proc = start_engine(port, "--profile", profile_name, "--speedup", "1")
    try:
        ttft, itl = asyncio.run(_latency(port, prompt_tokens, out_tokens, runs))
    finally:
        proc.terminate()
        proc.wait(5)
    return ttft, profile.expected_ttft_s(prompt_tokens), itl, profile.expected_itl_s(1, prompt_tokens)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per streamed request")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rate, cpu = throughput(a.streams, a.tokens, a.seconds, a.seed)
    print(f"\nstreamed output tokens/s, 1 engine process, {a.streams} concurrent streams, speedup 10000")
    print(
        f"| tokens/s | engine CPU (cores) | target |\n|---:|---:|---:|\n| {rate:,.0f} | {cpu:.2f} | 20,000 |"
    )
    print(f"\ntiming model at speedup 1 ({a.prompt_tokens}-token prompt, 1 request at a time, {a.runs} runs)")
    print("| profile | TTFT measured | TTFT model | ITL measured | ITL model |\n|---|---:|---:|---:|---:|")
    for name in ("ascend-910b", "h100"):
        ttft, ttft_m, itl, itl_m = timing(name, a.prompt_tokens, 32, a.runs)
        print(
            f"| {name} | {ttft * 1e3:.1f} ms | {ttft_m * 1e3:.1f} ms | {itl * 1e3:.2f} ms | {itl_m * 1e3:.2f} ms |"
        )


if __name__ == "__main__":
    main()
