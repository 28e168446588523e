"""Overhead of the mesh: the same simulated engines reached directly and through Tandem, side by side.

    python -m bench.overhead [--requests 2000] [--concurrency 32] [--engines 2] [--stream]

Requests alternate between the two paths in rounds, so both see the same machine state. Direct requests go
round-robin over the engines (an ideal client-side balancer); mesh requests go to Envoy's ingress. Printed:
requests/s, latency p50/p99 and what the mesh adds, TTFT with `--stream`, and CPU seconds per 1,000 requests of
Envoy and of the coordinator (from /proc, over the mesh rounds only).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from bench.harness import mesh_config
from tandem.config import parse_mesh_config
from tandem.up import Mesh
from tandem.version import __version__

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class PathStats:
    """Latencies of one path (seconds)."""

    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    busy_s: float = 0.0

    def pct(self, values: list[float], q: float) -> float:
        return (
            statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]
        )


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict, stats: PathStats, stream: bool
) -> None:
    start = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if stream:
                first = None
                async for _ in resp.content.iter_any():
                    if first is None:
                        first = time.perf_counter()
                if first is not None:
                    stats.ttfts.append(first - start)
            else:
                await resp.read()
            if resp.status != 200:
                stats.errors += 1
                return
    except aiohttp.ClientError:
        stats.errors += 1
        return
    stats.latencies.append(time.perf_counter() - start)


async def run_round(
    urls: list[str], count: int, concurrency: int, body: dict, stats: PathStats, stream: bool
) -> None:
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        counter = iter(range(count))

        async def worker() -> None:
            for i in counter:
                await one_request(session, urls[i % len(urls)], body, stats, stream)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        stats.busy_s += time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests per path")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="alternations between the two paths")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--speedup", type=float, default=10.0, help="simengine --speedup")
    parser.add_argument("--stream", action="store_true", help="stream the answers and report TTFT")
    parser.add_argument("--output", help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    config = mesh_config(engines=args.engines, engine_args=["--speedup", str(args.speedup)])
    config["envoy"]["log_level"] = "error"
    path = workdir / "mesh.yaml"
    path.write_text(yaml.safe_dump(config))
    mesh = Mesh(parse_mesh_config(config, str(path)), str(path), workdir / "run")
    body = {
        "model": "tandem-sim",
        "prompt": "Benchmark prompt " * 20,
        "max_tokens": args.max_tokens,
        "stream": args.stream,
    }
    direct_urls = [
        f"http://127.0.0.1:{e['port']}/v1/completions" for e in config["node_agents"][0]["engines"]
    ]
    mesh_urls = [f"http://{config['envoy']['http_listen']}/v1/completions"]
    direct, routed = PathStats(), PathStats()
    try:
        mesh.start()
        missing = mesh.wait_for_engines(60)
        if missing:
            print(f"engines not healthy: {missing}", file=sys.stderr)
            return 1
        pids = {c.name: c.process.pid for c in mesh.components if c.name in ("envoy", "coordinator")}
        asyncio.run(
            run_round(direct_urls + mesh_urls, 200, args.concurrency, body, PathStats(), args.stream)
        )  # warm-up
        cpu = dict.fromkeys(pids, 0.0)
        per_round = args.requests // args.rounds
        for r in range(args.rounds):
            asyncio.run(run_round(direct_urls, per_round, args.concurrency, body, direct, args.stream))
            before = {n: cpu_seconds(p) for n, p in pids.items()}
            asyncio.run(run_round(mesh_urls, per_round, args.concurrency, body, routed, args.stream))
            for n, p in pids.items():
                cpu[n] += cpu_seconds(p) - before[n]
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        mesh.stop()

    done = len(routed.latencies)
    rows = [
        (
            "requests ok / errors",
            f"{len(direct.latencies)} / {direct.errors}",
            f"{done} / {routed.errors}",
            "",
        ),
        (
            "requests/s",
            f"{len(direct.latencies) / direct.busy_s:.0f}",
            f"{done / routed.busy_s:.0f}",
            f"x{(done / routed.busy_s) / (len(direct.latencies) / direct.busy_s):.3f}",
        ),
    ]
    for q in (50, 99):
        d, m = direct.pct(direct.latencies, q) * 1e3, routed.pct(routed.latencies, q) * 1e3
        rows.append((f"latency p{q} (ms)", f"{d:.2f}", f"{m:.2f}", f"+{m - d:.2f} ms"))
    if args.stream:
        for q in (50, 99):
            d, m = direct.pct(direct.ttfts, q) * 1e3, routed.pct(routed.ttfts, q) * 1e3
            rows.append((f"TTFT p{q} (ms)", f"{d:.2f}", f"{m:.2f}", f"+{m - d:.2f} ms"))
    for name, seconds in cpu.items():
        rows.append((f"{name} CPU s / 1k requests", "", f"{seconds / done * 1000:.3f}", ""))
    mode = "streaming" if args.stream else "non-streaming"
    lines = [
        f"Overhead, {mode}: {args.requests} requests per path, concurrency {args.concurrency}, {args.engines} simengine "
        f"engines (speedup {args.speedup:g}, max_tokens {args.max_tokens}); tandem {__version__}, "
        f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
        "",
        "| figure | direct | through Tandem | mesh adds |",
        "|---|---:|---:|---:|",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows),
    ]
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
