"""Issue 22's overload scenario through the real mesh: `examples/tiers.yaml` (4 simengines scheduling by priority,
three tenants) under `tandem up`, on free loopback ports.

    python -m bench.tiers_live [--duration 60] [--overload 3] [--output docs/bench/tiers-live.md]

1. Unloaded: `gold` sends `--probe` priority requests one at a time; their TTFT p95 is the reference.
2. Capacity: `--clients` closed-loop clients of `gold` at tier `default` for `--calibrate-s`; completions per second
   are the fleet's capacity for this request shape (prompt of `--words` random words, `--max-tokens` out).
3. Overload, `--duration` seconds of Poisson arrivals: `free` (its default tier, `flex`) at `--overload` x capacity
   and `gold` (`priority`) at `--gold-share` x capacity, both open loop and streaming.
4. `tiny` (30 requests a minute) sends `--tiny` short requests one after another: 429 past its quota, every reply
   with OpenAI's x-ratelimit-* headers.
5. Every in-flight, workload and queue figure of `Admin/GetStats` back to zero (bounded wait).

The goals are the issue's: priority TTFT within its SLO (1 s in the example) and its p95 within 2x the unloaded p95
+ 100 ms; excess flex traffic gets 429 with `retry-after`; every admitted request completes; the gauges end at zero.
Exit 1 when a request fails otherwise or the gauges stay up; missed latency goals are reported, not hidden.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import yaml

from bench.chaos import UpProcess, wait
from bench.harness import free_ports
from bench.replay import percentile
from tandem.v1 import admin_pb2

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiers.yaml"
MODEL = "tandem-sim"
#: tiny's prompts are short, so that its request quota (30 a minute) binds before its token quota.
TINY_WORDS = 20
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def example_keys(text: str) -> dict[str, str]:
    """The tenants' example keys from the file's `# keys: name=KEY ...` line."""
    line = next(line for line in text.splitlines() if line.startswith("# keys: "))
    return dict(pair.split("=", 1) for pair in line[len("# keys: ") :].split())


def on_free_ports(config: dict) -> dict:
    """The example with every listener moved to a free loopback port (nothing else changes)."""
    listeners = [
        (config["envoy"], "http_listen"),
        (config["envoy"], "grpc_listen"),
        (config["envoy"], "callback_listen"),
        (config["coordinator"], "listen"),
        (config["coordinator"], "metrics_listen"),
        (config["conductor"], "listen"),
        (config["conductor"], "metrics_listen"),
    ]
    for agent in config["node_agents"]:
        listeners += [(agent, "listen"), (agent, "metrics_listen")]
    engines = [e for agent in config["node_agents"] for e in agent["engines"]]
    ports = iter(free_ports(len(listeners) + len(engines)))
    for section, key in listeners:
        section[key] = f"127.0.0.1:{next(ports)}"
    for engine in engines:
        engine["port"] = next(ports)
    return config


@dataclass
class Sent:
    """One request's outcome."""

    tenant: str
    status: int  # 0: no answer
    ttft_s: float | None = None  # to the first token, for answers that completed
    status_s: float | None = None  # to the status line (a 429: how long its client waited to learn it)
    complete: bool = False  # a 200 whose stream ended with [DONE]
    retry_after: str | None = None
    ratelimit_headers: bool = False


@dataclass
class Run:
    sent: list[Sent] = field(default_factory=list)

    def of(self, tenant: str) -> list[Sent]:
        return [s for s in self.sent if s.tenant == tenant]


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def send(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    tenant: str,
    text: str,
    max_tokens: int,
    tier: str | None,
) -> Sent:
    body = {
        "model": MODEL,
        "prompt": text,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        **({"service_tier": tier} if tier else {}),
    }
    start = time.perf_counter()
    try:
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            out = Sent(
                tenant,
                resp.status,
                status_s=time.perf_counter() - start,
                retry_after=resp.headers.get("retry-after"),
                ratelimit_headers=all(
                    f"x-ratelimit-{kind}-requests" in resp.headers for kind in ("limit", "remaining", "reset")
                ),
            )
            if resp.status != 200:
                await resp.read()
                return out
            first = None
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    out.complete = first is not None
                elif line.startswith(b"data: ") and first is None and b'"choices"' in line:
                    first = time.perf_counter()
                if line.startswith(b"data: ") and b'"error"' in line:
                    return out
            out.ttft_s = None if first is None else first - start
            return out
    except (TimeoutError, aiohttp.ClientError):
        return Sent(tenant, 0)


async def open_loop(
    url: str, streams: list[tuple[str, str, float, str | None]], duration_s: float, args, seed: int
) -> Run:
    """Poisson arrivals per `(tenant, key, rate, tier)` for `duration_s`; waits for every answer."""
    rng = random.Random(seed)
    run = Run()
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
    ) as session:
        start = time.perf_counter()
        tasks = []
        arrivals = []
        for tenant, key, rate, tier in streams:
            at = rng.expovariate(rate)
            while at < duration_s:
                arrivals.append((at, tenant, key, tier))
                at += rng.expovariate(rate)
        for at, tenant, key, tier in sorted(arrivals):
            delay = at - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            text = prompt(rng, args.words)
            tasks.append(asyncio.ensure_future(send(session, url, key, tenant, text, args.max_tokens, tier)))
        run.sent = list(await asyncio.gather(*tasks))
    return run


async def closed_loop(url: str, key: str, clients: int, duration_s: float, args, tier: str) -> float:
    """Completions per second of `clients` clients sending one request after another for `duration_s`."""
    rng = random.Random(1)
    done = 0
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
    ) as session:
        start = time.perf_counter()

        async def client() -> None:
            nonlocal done
            while time.perf_counter() - start < duration_s:
                sent = await send(session, url, key, "gold", prompt(rng, args.words), args.max_tokens, tier)
                if sent.complete:
                    done += 1

        await asyncio.gather(*(client() for _ in range(clients)))
        return done / (time.perf_counter() - start)


async def sequential(url: str, key: str, tenant: str, count: int, words: int, args) -> list[Sent]:
    """`count` requests of `words` random words, one after another, at the tenant's default tier."""
    rng = random.Random(2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return [
            await send(session, url, key, tenant, prompt(rng, words), args.max_tokens, None)
            for _ in range(count)
        ]


def gauges(up: UpProcess) -> dict[str, float]:
    """`Admin/GetStats`'s gauges that must read 0 when nothing runs."""
    stats = up.admin("GetStats", admin_pb2.GetStatsRequest())
    return {
        "requests_inflight": stats.requests_inflight,
        "workload_tokens": stats.workload_tokens,
        "tenant_inflight": sum(t.requests_inflight for t in stats.tenants),
        "queued_now": sum(q.queued_now for q in stats.queues),
    }


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def ms(value: float) -> str:
    return "-" if value != value else f"{value * 1000:.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of overload (default 60)")
    parser.add_argument("--overload", type=float, default=3.0, help="free's rate, x capacity (default 3)")
    parser.add_argument("--gold-share", type=float, default=0.1, help="gold's rate, x capacity (default 0.1)")
    parser.add_argument(
        "--words", type=int, default=1000, help="prompt length in random words (default 1000)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default 16)")
    parser.add_argument("--probe", type=int, default=20, help="unloaded priority requests (default 20)")
    parser.add_argument(
        "--clients", type=int, default=32, help="closed-loop clients for capacity (default 32)"
    )
    parser.add_argument("--calibrate-s", type=float, default=20.0, help="capacity window (default 20 s)")
    parser.add_argument("--tiny", type=int, default=40, help="tiny's sequential requests (default 40)")
    parser.add_argument("--output", help="write the markdown here")
    args = parser.parse_args(argv)

    text = EXAMPLE.read_text()
    keys = example_keys(text)
    config = on_free_ports(yaml.safe_load(text))
    slo_s = config["coordinator"]["flow_control"]["priority"]["ttft_slo_s"]
    workdir = Path(tempfile.mkdtemp(prefix="tandem-tiers-live-"))
    load_start = os.getloadavg()[0]
    started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    up = UpProcess(config, workdir)
    up.start()
    url = up.http + "/v1/completions"
    failures: list[str] = []
    try:
        wait(lambda: len(up.healthy_instances()) == 4, 60, "four healthy engines")
        unloaded = asyncio.run(sequential(url, keys["gold"], "gold", args.probe, args.words, args))
        base = [s.ttft_s for s in unloaded if s.ttft_s is not None]
        base_p95 = percentile(base, 95)
        capacity = asyncio.run(
            closed_loop(url, keys["gold"], args.clients, args.calibrate_s, args, "default")
        )
        wait(lambda: gauges(up)["requests_inflight"] == 0, 60, "the calibration's requests ended")
        streams = [
            ("free", keys["free"], args.overload * capacity, None),
            ("gold", keys["gold"], args.gold_share * capacity, None),
        ]
        run = asyncio.run(open_loop(url, streams, args.duration, args, seed=3))
        tiny = asyncio.run(sequential(url, keys["tiny"], "tiny", args.tiny, TINY_WORDS, args))
        try:
            wait(lambda: not any(gauges(up).values()), 60, "every gauge back to zero")
            settled = gauges(up)
        except AssertionError:
            settled = gauges(up)
            failures.append(f"gauges not back to zero: {settled}")
        load_end = os.getloadavg()[0]
    finally:
        code = up.stop()
    if code != 0:
        failures.append(f"tandem up exited {code}")

    gold, free = run.of("gold"), run.of("free")
    gold_ttft = [s.ttft_s for s in gold if s.ttft_s is not None]
    gold_p95 = percentile(gold_ttft, 95)
    within = sum(t <= slo_s for t in gold_ttft) / len(gold) if gold else float("nan")
    p95_goal = 2 * base_p95 + 0.1
    shed = [s for s in free if s.status == 429]
    shed_with_retry = sum(s.retry_after is not None for s in shed)
    admitted = [s for s in run.sent if s.status == 200]
    incomplete = [s for s in admitted if not s.complete]
    other = [s for s in run.sent if s.status not in (200, 429)]
    gold_429 = [s for s in gold if s.status == 429]
    tiny_429 = [i for i, s in enumerate(tiny) if s.status == 429]
    tiny_headers = sum(s.ratelimit_headers for s in tiny)
    tiny_retry = sum(s.retry_after is not None for s in tiny if s.status == 429)
    if incomplete:
        failures.append(f"{len(incomplete)} admitted requests did not complete")
    if other:
        failures.append(
            f"{len(other)} requests failed otherwise: statuses {sorted({s.status for s in other})}"
        )
    lines = [
        f"`examples/tiers.yaml` under `tandem up` (4 simengines, ascend-910b timing, `--scheduling-policy priority`; "
        f"mutual TLS inside, API keys at Envoy), every listener on a free loopback port. Requests: {args.words} "
        f"random words, {args.max_tokens} tokens out, streaming. {started} UTC, load average {load_start:.2f} at "
        f"the start and {load_end:.2f} at the end.",
        "",
        f"- Unloaded `gold` (priority, {len(unloaded)} one at a time): TTFT p50 {ms(percentile(base, 50))} ms, "
        f"p95 {ms(base_p95)} ms.",
        f"- Capacity ({args.clients} closed-loop clients of `gold` at tier `default`, {args.calibrate_s:g} s): "
        f"{capacity:.2f} requests/s.",
        f"- Overload, {args.duration:g} s: `free` (flex) Poisson at {args.overload:g}x capacity, `gold` (priority) "
        f"at {args.gold_share:g}x.",
        "",
        "| tenant | sent | 200 complete | 429 (with retry-after) | 429 after p50 / max (ms) | other | TTFT p50 | p95 "
        "| p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, sent in (("gold", gold), ("free", free)):
        ttft = [s.ttft_s for s in sent if s.ttft_s is not None]
        shed_of = [s for s in sent if s.status == 429]
        learnt = [s.status_s for s in shed_of if s.status_s is not None]
        shed_after = f"{ms(percentile(learnt, 50))} / {ms(max(learnt))}" if learnt else "-"
        lines.append(
            f"| {name} | {len(sent)} | {sum(s.complete for s in sent)} | {len(shed_of)} "
            f"({sum(s.retry_after is not None for s in shed_of)}) | {shed_after} | "
            f"{sum(s.status not in (200, 429) for s in sent)} | {ms(percentile(ttft, 50))} | "
            f"{ms(percentile(ttft, 95))} | {ms(percentile(ttft, 99))} |"
        )
    lines += [
        "",
        "| goal | figure | verdict |",
        "|---|---|---|",
        f"| priority TTFT within its SLO ({slo_s:g} s) | {within:.1%} of {len(gold)} | {verdict(within >= 0.99)} |",
        f"| priority p95 <= 2 x unloaded p95 + 100 ms ({ms(p95_goal)} ms) | {ms(gold_p95)} ms | "
        f"{verdict(gold_p95 <= p95_goal)} |",
        f"| excess flex gets 429 with retry-after | {len(shed)} shed, {shed_with_retry} with retry-after, "
        f"{len(gold_429)} priority 429s | {verdict(bool(shed) and shed_with_retry == len(shed) and not gold_429)} |",
        f"| every admitted request completes | {len(admitted) - len(incomplete)} of {len(admitted)}; "
        f"{len(other)} other failures | {verdict(not incomplete and not other)} |",
        f"| `tiny` (30/min) gets 429 past its quota, x-ratelimit-* on every reply | first 429 at request "
        f"{tiny_429[0] + 1 if tiny_429 else '-'} of {len(tiny)}, {len(tiny_429)} in all ({tiny_retry} with "
        f"retry-after); headers on {tiny_headers} of {len(tiny)} | "
        f"{verdict(bool(tiny_429) and tiny_headers == len(tiny) and tiny_retry == len(tiny_429))} |",
        f"| gauges back to zero (`Admin/GetStats`) | {json.dumps(settled)} | {verdict(not any(settled.values()))} |",
    ]
    if failures:
        lines += ["", "Failures: " + "; ".join(failures)]
    report = "\n".join(lines)
    print(report)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(report + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
