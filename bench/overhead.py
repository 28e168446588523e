"""Overhead of the routers: the same simulated engines reached directly, through Tandem and through the peer
routers (`sglang-router`, `vllm-router`, each round-robin and cache-aware), side by side in one run.

    python -m bench.overhead [--requests 2000] [--concurrency 32] [--engines 4] [--stream] [--paths ...]

Scenarios: non-streaming and streaming at `--concurrency` (streaming twice: reused client connections and a
fresh connection per request), and streaming at `--wide` concurrent streams. In every scenario the paths take
turns in `--rounds` rounds so that all see the same machine state. Direct requests go round-robin over the
engines (an ideal client-side balancer). Tandem runs with `round_robin` and with `kv_affinity` (switched by
rewriting the mesh file, which the coordinator reloads). Printed per scenario and path: requests/s, latency
p50/p99 and what the path adds over direct, streamed TTFT and inter-token latency p50/p99, and CPU seconds per
1,000 requests of the router's processes (Envoy + coordinator + conductor for Tandem), from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from bench.harness import mesh_config
from bench.peers import PEERS, start_peer, version
from bench.replay import percentile
from mesh.config import parse_mesh_config
from mesh.up import Mesh
from tandem.version import __version__

_TICK = os.sysconf("SC_CLK_TCK")

#: name -> (stream, fresh connection per request, concurrency option, request count option)
SCENARIOS = {
    "non-streaming": (False, False, "concurrency", "requests"),
    "streaming": (True, False, "concurrency", "requests"),
    "streaming, fresh connections": (True, True, "concurrency", "fresh_requests"),
    "streaming, wide": (True, False, "wide", "requests"),
}
TANDEM_PATHS = {"tandem round_robin": "round_robin", "tandem kv_affinity": "kv_affinity"}
ALL_PATHS = ["direct", *TANDEM_PATHS, *PEERS]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its descendants (reaped ones included)."""
    total = 0.0
    for p in [pid, *_descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) / _TICK
    return total


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


@dataclass
class PathStats:
    """Measurements of one path in one scenario (seconds)."""

    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    errors: int = 0
    busy_s: float = 0.0
    cpu_s: float = 0.0
    cpu_by: dict[str, float] = field(default_factory=dict)  # per process, when the router has several

    @staticmethod
    def pct(values: list[float], q: int) -> float:
        return percentile(values, q)

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.busy_s if self.busy_s else float("nan")


async def one_request(
    session: aiohttp.ClientSession, url: str, body: dict, stats: PathStats, stream: bool
) -> None:
    start = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                await resp.read()
                stats.errors += 1
                return
            if stream:
                first = last = None
                events = 0
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    last = time.perf_counter()
                    if first is None:
                        first = last
                        stats.ttfts.append(first - start)
                    events += 1
                if events > 1:
                    stats.itls.append((last - first) / (events - 1))
            else:
                await resp.read()
    except (TimeoutError, aiohttp.ClientError):
        stats.errors += 1
        return
    stats.latencies.append(time.perf_counter() - start)


async def run_round(
    urls: list[str], count: int, concurrency: int, body: dict, stats: PathStats, stream: bool, fresh: bool
) -> None:
    connector = aiohttp.TCPConnector(limit=concurrency * 2, force_close=fresh)
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


@dataclass
class Path_:
    """One way to reach the engines."""

    name: str
    urls: list[str]
    pids: dict[str, int]  # process name -> pid
    policy: str = ""  # Tandem's scheduler policy for this path


class Bench:
    """The mesh, the peers, and the paths over them."""

    def __init__(self, args) -> None:
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="tandem-overhead-"))
        self.config = mesh_config(engines=args.engines, engine_args=["--speedup", str(args.speedup)])
        self.config["envoy"]["log_level"] = "error"
        self.config_path = self.workdir / "mesh.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.mesh = Mesh(
            parse_mesh_config(self.config, str(self.config_path)), str(self.config_path), self.workdir / "run"
        )
        self.peers = []
        self.policy = "least_load"

    def set_policy(self, policy: str) -> None:
        """Switches Tandem's policy through a config reload (the coordinator polls the file every second)."""
        if policy == self.policy:
            return
        self.config["coordinator"]["scheduler"] = {"policy": policy}
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.policy = policy
        time.sleep(2.5)

    def start(self) -> list[Path_]:
        self.mesh.start()
        missing = self.mesh.wait_for_engines(60)
        if missing:
            raise RuntimeError(f"engines not healthy: {missing}")
        engines = [f"127.0.0.1:{e['port']}" for e in self.config["node_agents"][0]["engines"]]
        pids = {
            c.name: c.process.pid
            for c in self.mesh.components
            if c.name in ("envoy", "coordinator", "conductor")
        }
        paths = []
        for name in self.args.paths:
            if name == "direct":
                paths.append(Path_(name, [f"http://{e}/v1/completions" for e in engines], {}))
            elif name in TANDEM_PATHS:
                url = f"http://{self.config['envoy']['http_listen']}/v1/completions"
                paths.append(Path_(name, [url], pids, TANDEM_PATHS[name]))
            else:
                peer = start_peer(name, engines, self.workdir)
                self.peers.append(peer)
                paths.append(Path_(name, [f"{peer.url}/v1/completions"], {"router": peer.pid}))
        return paths

    def stop(self) -> None:
        for peer in self.peers:
            peer.stop()
        self.mesh.stop()

    def measure(self, paths: list[Path_], progress=None) -> dict[str, dict[str, PathStats]]:
        a = self.args
        body = {"model": "tandem-sim", "prompt": "Benchmark prompt " * 20, "max_tokens": a.max_tokens}
        out: dict[str, dict[str, PathStats]] = {}
        for scenario in a.scenarios:
            stream, fresh, conc_key, count_key = SCENARIOS[scenario]
            concurrency = getattr(a, conc_key)
            b = {**body, "stream": stream}
            stats = {p.name: PathStats() for p in paths}
            per_round = getattr(a, count_key) // a.rounds
            # Tandem's policy switches cost a reload: order the paths so each round switches at most twice.
            ordered = sorted(paths, key=lambda p: (p.policy != "round_robin", p.policy == ""))
            for _ in range(a.rounds):
                for p in ordered:
                    if p.policy:
                        self.set_policy(p.policy)
                    before = {n: cpu_seconds(pid) for n, pid in p.pids.items()}
                    st = stats[p.name]
                    asyncio.run(run_round(p.urls, per_round, concurrency, b, st, stream, fresh))
                    for n, pid in p.pids.items():
                        used = cpu_seconds(pid) - before[n]
                        st.cpu_s += used
                        st.cpu_by[n] = st.cpu_by.get(n, 0.0) + used
                    if progress is not None:
                        progress(per_round)
            out[scenario] = stats
        return out


def tables(results: dict[str, dict[str, PathStats]], args) -> str:
    lines = [
        f"Overhead: {args.requests} requests per path and scenario in {args.rounds} alternating rounds, "
        f"concurrency {args.concurrency} (wide: {args.wide} streams), {args.engines} simengine engines (speedup "
        f"{args.speedup:g}, max_tokens {args.max_tokens}); tandem {__version__}, sglang-router "
        f"{version('sglang')}, vllm-router {version('vllm')}; {platform.machine()} {os.cpu_count()} cores, "
        f'Python {platform.python_version()}. Latencies in ms; "+" is what the path adds over direct; ITL is '
        "each request's mean gap between streamed events (p50/p99 over requests); fresh connections: "
        f"{args.fresh_requests} requests per path.",
    ]
    for scenario, stats in results.items():
        stream = SCENARIOS[scenario][0]
        d = stats.get("direct")
        lines += ["", f"**{scenario}**", ""]
        head = "| path | ok / errors | req/s | p50 | p99 | + p50 | + p99 |"
        sep = "|---|---:|---:|---:|---:|---:|---:|"
        if stream:
            head += " TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |"  # ITL: per request, mean gap between events
            sep += "---:|---:|---:|---:|"
        head += " CPU s / 1k req |"
        sep += "---:|"
        lines += [head, sep]
        for name, s in stats.items():
            p50, p99 = s.pct(s.latencies, 50) * 1e3, s.pct(s.latencies, 99) * 1e3
            add50 = add99 = ""
            if d is not None and name != "direct":
                add50 = f"{p50 - d.pct(d.latencies, 50) * 1e3:+.2f}"
                add99 = f"{p99 - d.pct(d.latencies, 99) * 1e3:+.2f}"
            row = f"| {name} | {len(s.latencies)} / {s.errors} | {s.rps:.0f} | {p50:.2f} | {p99:.2f} | {add50} | {add99} |"
            if stream:
                row += (
                    f" {s.pct(s.ttfts, 50) * 1e3:.2f} | {s.pct(s.ttfts, 99) * 1e3:.2f} "
                    f"| {s.pct(s.itls, 50) * 1e3:.2f} | {s.pct(s.itls, 99) * 1e3:.2f} |"
                )
            cpu = ""
            if name != "direct" and s.latencies:
                cpu = f"{s.cpu_s / len(s.latencies) * 1000:.2f}"
                if len(s.cpu_by) > 1:
                    cpu += (
                        " ("
                        + ", ".join(f"{n} {v / len(s.latencies) * 1000:.2f}" for n, v in s.cpu_by.items())
                        + ")"
                    )
            lines.append(row + f" {cpu} |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, PathStats]], path: Path) -> None:
    """Added p50 latency and CPU per 1k requests, per path and scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(results)
    names = [n for n in next(iter(results.values())) if n != "direct"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(len(scenarios), 1)
    for i, sc in enumerate(scenarios):
        st = results[sc]
        d = st.get("direct")
        xs = [x + (i - (len(scenarios) - 1) / 2) * width for x in range(len(names))]
        base = d.pct(d.latencies, 50) if d is not None else 0.0
        axes[0].bar(xs, [(st[n].pct(st[n].latencies, 50) - base) * 1e3 for n in names], width, label=sc)
        axes[1].bar(xs, [st[n].cpu_s / max(len(st[n].latencies), 1) * 1000 for n in names], width, label=sc)
    for ax, title in zip(
        axes, ("added p50 latency over direct (ms)", "router CPU s per 1k requests"), strict=True
    ):
        ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests per path and scenario")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--wide", type=int, default=256, help="concurrent streams of the wide scenario")
    parser.add_argument(
        "--fresh-requests", type=int, default=500, help="requests per path, fresh connections"
    )
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="alternations between the paths")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--speedup", type=float, default=10.0, help="simengine --speedup")
    parser.add_argument("--stream", action="store_true", help="only the streaming scenarios")
    parser.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), metavar="SCENARIO")
    parser.add_argument("--paths", nargs="+", default=ALL_PATHS, choices=ALL_PATHS, metavar="PATH")
    parser.add_argument("--output", help="also write the tables (markdown) to this file")
    parser.add_argument("--plot", help="write a PNG plot to this file")
    args = parser.parse_args(argv)
    if not args.scenarios:
        args.scenarios = [s for s in SCENARIOS if SCENARIOS[s][0] or not args.stream]

    from tqdm import tqdm

    bench = Bench(args)
    counts = [getattr(args, SCENARIOS[s][3]) // args.rounds * args.rounds for s in args.scenarios]
    total = sum(counts) * len(args.paths)
    try:
        paths = bench.start()
        warm = {"model": "tandem-sim", "prompt": "warm up", "max_tokens": 2}
        for p in paths:
            asyncio.run(run_round(p.urls, 50, 8, warm, PathStats(), False, False))
        with tqdm(total=total, desc="overhead", unit="req", file=sys.stderr) as bar:
            results = bench.measure(paths, bar.update)
    finally:
        bench.stop()
    text = tables(results, args)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    if args.plot:
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
