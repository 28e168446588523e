"""Overhead of the routers: the same simulated engines reached directly, through Tandem and through the peer
routers (`sglang-router`, `vllm-router`, each round-robin and cache-aware), side by side in one run.

    python -m bench.overhead [--requests 1500] [--concurrency 32] [--engines 4] [--paths ...] [--scenarios ...]

Scenarios: non-streaming and streaming, on reused client connections and with a fresh connection per request, at
`--concurrency` and at concurrency 1; and the decision path alone: non-streaming requests to a do-nothing upstream
(`bench/decision_only.py`), which answers at once, so that what a path adds is the router's own work. In every
scenario the paths take turns in `--rounds` rounds so that all see the same machine state. Direct requests go
round-robin over the engines (an ideal client-side balancer).

Tandem paths: the mesh as `tandem up` runs it (an aggregated mesh decides with ext_authz), with `round_robin` and
`kv_affinity` (switched by rewriting the mesh file, which the coordinator reloads); the same coordinator behind a
second Envoy rendered with `envoy.decision: ext_proc` (one body message each way). Printed per scenario and path: requests/s, latency
p50/p99 and what the path adds over direct, streamed TTFT and inter-token latency p50/p99, and CPU seconds per
1,000 requests of every process of the router (Envoy + coordinator (+ its tokenizer worker) + conductor for
Tandem), from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.decision_only import Registrar, start_null
from bench.harness import free_ports, mesh_config, wait_until
from bench.peers import PEERS, start_peer, version
from bench.replay import percentile
from mesh.config import parse_mesh_config
from mesh.envoy import admin_get, write_envoy_config
from mesh.up import Mesh, envoy_binary
from tandem.protogen import DESCRIPTOR
from tandem.version import __version__

_TICK = os.sysconf("SC_CLK_TCK")

#: name -> (stream, fresh connection per request, concurrency option, request count option, upstream)
SCENARIOS = {
    "non-streaming": (False, False, "concurrency", "requests", "engines"),
    "streaming": (True, False, "concurrency", "requests", "engines"),
    "streaming, fresh connections": (True, True, "concurrency", "fresh_requests", "engines"),
    "non-streaming, concurrency 1": (False, False, "one", "serial_requests", "engines"),
    "streaming, concurrency 1": (True, False, "one", "serial_requests", "engines"),
    "streaming, fresh connections, concurrency 1": (True, True, "one", "serial_requests", "engines"),
    "decision path alone (do-nothing upstream)": (False, False, "concurrency", "requests", "null"),
    "decision path alone (do-nothing upstream), concurrency 1": (
        False,
        False,
        "one",
        "serial_requests",
        "null",
    ),
}
#: label -> (policy, decision path)
TANDEM_PATHS = {
    "tandem round_robin": ("round_robin", "mesh"),
    "tandem kv_affinity": ("kv_affinity", "mesh"),
    "tandem ext_proc round_robin": ("round_robin", "ext_proc"),
}
#: Peers also run in front of the do-nothing upstream (cache-aware ones need engine endpoints it lacks).
NULL_PEERS = ("sglang-router round_robin", "vllm-router round_robin")
ALL_PATHS = ["direct", *TANDEM_PATHS, *PEERS]
NULL_MODEL = "null"
#: From the engines' health to the idle window: their agents read each engine twice before it counts as idle.
IDLE_SETTLE_S = 3.0
IDLE_GOAL_PCT = 0.5  # issue 24: agent and engine together, per idle engine, % of one core


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its descendants (reaped ones included)."""
    return sum(own_cpu_seconds(p, reaped_children=True) for p in [pid, *_descendants(pid)])


def own_cpu_seconds(pid: int, reaped_children: bool = False) -> float:
    """User + system CPU time of one process (0 when it is gone); with `reaped_children`, plus that of its children
    that have exited and been waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11 : 15 if reaped_children else 13]) / _TICK


@dataclass
class Idle:
    """CPU of the mesh's processes over a window with no requests, as a share of one core."""

    seconds: float
    engines: int
    share: dict[str, float]  # process kind (agent, engines, envoy, coordinator, conductor) -> % of a core

    @property
    def per_engine(self) -> float:
        """Agent and engines, per engine: what supervising one more idle engine costs."""
        return (self.share["agent"] + self.share["engines"]) / self.engines


def measure_idle(mesh: Mesh, seconds: float) -> Idle:
    """Every process `tandem up` started, and the engines its agents started, over `seconds` of no requests."""
    kinds: dict[str, list[int]] = {}
    for c in mesh.components:
        if c.process is None:
            continue
        kind = "agent" if c.name.startswith("agent-") else c.name
        kinds.setdefault(kind, []).append(c.process.pid)
        if kind == "agent":
            kinds.setdefault("engines", []).extend(_descendants(c.process.pid))
    before = {k: sum(own_cpu_seconds(p) for p in pids) for k, pids in kinds.items()}
    t0 = time.monotonic()
    time.sleep(seconds)  # the measurement window itself
    took = time.monotonic() - t0
    share = {k: 100 * (sum(own_cpu_seconds(p) for p in pids) - before[k]) / took for k, pids in kinds.items()}
    engines = sum(len(a.engines) for a in mesh.mesh.node_agents)
    return Idle(took, engines, share)


def idle_table(idle: Idle) -> str:
    """The idle window as a markdown paragraph and table."""
    order = ["agent", "engines", "envoy", "coordinator", "conductor"]
    kinds = [k for k in order if k in idle.share] + sorted(set(idle.share) - set(order))
    verdict = "met" if idle.per_engine <= IDLE_GOAL_PCT else "not met"
    return "\n".join(
        [
            f"**idle: {idle.seconds:.0f} s with no requests, before any other path started** (CPU as % of one core, "
            f"every process of the mesh; its {idle.engines} engines are the agent's children). Issue 24's goal, agent "
            f"and engine together <= {IDLE_GOAL_PCT:g}% of a core per engine: {idle.per_engine:.2f}%, {verdict}.",
            "",
            "| " + " | ".join(kinds) + " | agent + engine, per engine |",
            "|" + "---:|" * (len(kinds) + 1),
            "| " + " | ".join(f"{idle.share[k]:.2f}" for k in kinds) + f" | {idle.per_engine:.2f} |",
        ]
    )


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
    agent_s: float = 0.0  # Tandem's node agents (their own CPU, not their engines'): the rest of the mesh

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
    urls: list[str],
    count: int,
    concurrency: int,
    body: dict,
    stats: PathStats,
    stream: bool,
    fresh: bool,
    headers: dict[str, str] | None = None,
) -> None:
    connector = aiohttp.TCPConnector(limit=concurrency * 2, force_close=fresh)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120), headers=headers
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
    """One way to reach the engines (and the do-nothing upstream)."""

    name: str
    urls: dict[str, list[str]]  # upstream ("engines" | "null") -> URLs to spread requests over
    pids: dict[str, dict[str, int]]  # upstream -> process name -> pid
    policy: str = ""  # Tandem's scheduler policy for this path


class Bench:
    """The mesh, the peers, and the paths over them."""

    def __init__(self, args) -> None:
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="tandem-overhead-"))
        self.config = mesh_config(engines=args.engines, engine_args=["--speedup", str(args.speedup)])
        self.config["envoy"]["log_level"] = "error"
        # Plain text between components, as for the peer routers: what mutual TLS costs is
        # measured on its own (bench/mtls.py), and the decision-only registrars speak plain gRPC.
        self.config["security"] = {"insecure": True}
        self.config_path = self.workdir / "mesh.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.mesh = Mesh(
            parse_mesh_config(self.config, str(self.config_path)), str(self.config_path), self.workdir / "run"
        )
        self.peers: list = []
        self.others: list[subprocess.Popen] = []
        self.registrars: list[Registrar] = []
        self.policy = "least_load"
        self.idle: Idle | None = None
        self.agent_pids: list[int] = []

    def set_policy(self, policy: str) -> None:
        """Switches Tandem's policy through a config reload (the coordinator polls the file every second)."""
        if policy == self.policy:
            return
        self.config["coordinator"]["scheduler"] = {"policy": policy}
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.policy = policy
        time.sleep(2.5)

    def second_envoy(
        self, slug: str, transform: Callable[[dict], dict] | None = None, **envoy: Any
    ) -> tuple[str, int]:
        """Another Envoy in front of the same coordinator and engines, rendered from the mesh file with the `envoy:`
        keys `envoy` changed and the rendered configuration passed through `transform`; its URL and pid."""
        ports = free_ports(3)
        admin = self.workdir / f"envoy-{slug}-admin.sock"
        data = yaml.safe_load(yaml.safe_dump(self.config))
        data["envoy"].update(
            http_listen=f"127.0.0.1:{ports[0]}",
            grpc_listen=f"127.0.0.1:{ports[1]}",
            admin_socket=str(admin),
            callback_listen=f"127.0.0.1:{ports[2]}",
            base_id=ports[0],
            **envoy,
        )
        path = write_envoy_config(parse_mesh_config(data), DESCRIPTOR, self.workdir / f"envoy-{slug}.yaml")
        if transform is not None:
            path.write_text(yaml.safe_dump(transform(yaml.safe_load(path.read_text()))))
        argv = [envoy_binary(), "-c", str(path), "--base-id", str(ports[0]), "--log-level", "error"]
        proc = subprocess.Popen([*argv, "--concurrency", "1"])
        self.others.append(proc)
        ready = lambda: admin.exists() and admin_get(admin, "/ready")[0] == 200  # noqa: E731
        wait_until(ready, 30, f"the {slug} Envoy ready", 0.1, ignore=(OSError,))
        return f"http://127.0.0.1:{ports[0]}/v1/completions", proc.pid

    def start(self) -> list[Path_]:
        self.mesh.start()
        missing = self.mesh.wait_for_engines(60)
        if missing:
            raise RuntimeError(f"engines not healthy: {missing}")
        if self.args.idle_s:
            time.sleep(IDLE_SETTLE_S)  # the agents' first reads of each engine, before it counts as idle
            self.idle = measure_idle(self.mesh, self.args.idle_s)
        engines = [f"127.0.0.1:{e['port']}" for e in self.config["node_agents"][0]["engines"]]
        null_proc, nulls = start_null(self.args.engines)
        self.others.append(null_proc)
        coordinator = self.config["coordinator"]["listen"]
        self.registrars.append(Registrar(coordinator, NULL_MODEL, nulls, "null"))
        pids = {
            c.name: c.process.pid
            for c in self.mesh.components
            if c.name in ("envoy", "coordinator", "conductor")
        }
        self.agent_pids = [c.process.pid for c in self.mesh.components if c.name.startswith("agent-")]
        mesh_url = f"http://{self.config['envoy']['http_listen']}/v1/completions"
        paths = []
        for name in self.args.paths:
            if name == "direct":
                urls = {"engines": [f"http://{e}/v1/completions" for e in engines]}
                urls["null"] = [f"http://{n}/v1/completions" for n in nulls]
                paths.append(Path_(name, urls, {"engines": {}, "null": {}}))
            elif name in TANDEM_PATHS:
                policy, decision = TANDEM_PATHS[name]
                url, path_pids = mesh_url, pids
                if decision == "ext_proc":
                    url, envoy_pid = self.second_envoy("ext-proc", decision="ext_proc")
                    path_pids = {**pids, "envoy": envoy_pid}
                paths.append(
                    Path_(
                        name,
                        {"engines": [url], "null": [url]},
                        {"engines": path_pids, "null": path_pids},
                        policy,
                    )
                )
            else:
                peer = start_peer(name, engines, self.workdir)
                self.peers.append(peer)
                urls = {"engines": [f"{peer.url}/v1/completions"]}
                path_pids = {"engines": {"router": peer.pid}}
                if name in NULL_PEERS:
                    null_peer = start_peer(name, nulls, self.workdir)
                    self.peers.append(null_peer)
                    urls["null"] = [f"{null_peer.url}/v1/completions"]
                    path_pids["null"] = {"router": null_peer.pid}
                paths.append(Path_(name, urls, path_pids))
        for registrar in self.registrars:
            registrar.start()
        time.sleep(2)  # the registrars' first heartbeats
        return paths

    def stop(self) -> None:
        for registrar in self.registrars:
            registrar.stop()
        for peer in self.peers:
            peer.stop()
        for proc in self.others:
            proc.terminate()
            proc.wait(10)
        self.mesh.stop()

    def measure(self, paths: list[Path_], progress=None) -> dict[str, dict[str, PathStats]]:
        a = self.args
        prompt = "Benchmark prompt " * 20
        out: dict[str, dict[str, PathStats]] = {}
        for scenario in a.scenarios:
            stream, fresh, conc_key, count_key, upstream = SCENARIOS[scenario]
            concurrency = 1 if conc_key == "one" else getattr(a, conc_key)
            model = NULL_MODEL if upstream == "null" else "tandem-sim"
            body = {"model": model, "prompt": prompt, "max_tokens": a.max_tokens, "stream": stream}
            runnable = [p for p in paths if upstream in p.urls]
            stats = {p.name: PathStats() for p in runnable}
            per_round = getattr(a, count_key) // a.rounds
            # Tandem's policy switches cost a reload: order the paths so each round switches at most twice.
            ordered = sorted(runnable, key=lambda p: (p.policy != "round_robin", p.policy == ""))
            for _ in range(a.rounds):
                for p in ordered:
                    if p.policy:
                        self.set_policy(p.policy)
                    pids = p.pids[upstream]
                    agents = self.agent_pids if p.policy else []
                    before = {n: cpu_seconds(pid) for n, pid in pids.items()}
                    agents_before = sum(own_cpu_seconds(pid) for pid in agents)
                    st = stats[p.name]
                    asyncio.run(run_round(p.urls[upstream], per_round, concurrency, body, st, stream, fresh))
                    for n, pid in pids.items():
                        used = cpu_seconds(pid) - before[n]
                        st.cpu_s += used
                        st.cpu_by[n] = st.cpu_by.get(n, 0.0) + used
                    st.agent_s += sum(own_cpu_seconds(pid) for pid in agents) - agents_before
                    if progress is not None:
                        progress(per_round)
            out[scenario] = stats
        return out


def tables(results: dict[str, dict[str, PathStats]], args) -> str:
    lines = [
        f"Overhead: {args.requests} requests per path and scenario in {args.rounds} alternating rounds at "
        f"concurrency {args.concurrency}, {args.serial_requests} at concurrency 1; {args.engines} simengine engines (speedup "
        f"{args.speedup:g}, max_tokens {args.max_tokens}); tandem {__version__}, sglang-router "
        f"{version('sglang')}, vllm-router {version('vllm')}; {platform.machine()} {os.cpu_count()} cores, "
        f'Python {platform.python_version()}. Latencies in ms; "+" is what the path adds over direct; ITL is '
        "each request's mean gap between streamed events (p50/p99 over requests); fresh connections: "
        f"{args.fresh_requests} requests per path at concurrency {args.concurrency}. Load average (1 min, 2 shared cores) at start "
        f"{args.load_start:.2f}, at end {args.load_end:.2f}.",
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
                    k = 1000 / len(s.latencies)
                    cpu += " (" + ", ".join(f"{n} {v * k:.2f}" for n, v in s.cpu_by.items())
                    cpu += f"; node agent {s.agent_s * k:.2f}, whole mesh {(s.cpu_s + s.agent_s) * k:.2f})"
            lines.append(row + f" {cpu} |")
    return "\n".join(lines)


def _cpu(s: PathStats) -> float:
    return s.cpu_s / len(s.latencies) * 1000 if s.latencies else float("nan")


def _added(stats: dict[str, PathStats], name: str, values: str) -> float:
    d, s = stats.get("direct"), stats.get(name)
    if d is None or s is None or not getattr(s, values) or not getattr(d, values):
        return float("nan")
    return (s.pct(getattr(s, values), 50) - d.pct(getattr(d, values), 50)) * 1e3


def verdicts(results: dict[str, dict[str, PathStats]]) -> str:
    """Issue 14's goals against this run: Tandem's default path (ext_authz for an aggregated mesh) and its ext_proc
    path, each against the goal and the best peer in the same scenario."""
    tandem = ["tandem round_robin", "tandem ext_proc round_robin"]
    rows = []

    def row(goal: str, scenario: str, metric, target: float, unit: str, peers_too: bool = True) -> None:
        stats = results.get(scenario)
        if stats is None:
            return
        values = [metric(stats, n) if n in stats else float("nan") for n in tandem]
        peers = [metric(stats, n) for n in stats if n in PEERS] if peers_too else []
        best = min(peers) if peers else float("nan")
        bound = best if target != target else target  # nan target: the best peer is the bar
        verdict = "met" if values[0] <= bound else "not met"
        cells = " | ".join(f"{v:.2f}" for v in values)
        rows.append(f"| {goal} | {scenario} | {cells} | {best:.2f} | {verdict} |")

    cpu = lambda st, n: _cpu(st[n])  # noqa: E731
    for scenario in ("non-streaming", "streaming", "decision path alone (do-nothing upstream)"):
        row(
            "CPU s / 1k requests (whole router) at or below the best peer's", scenario, cpu, float("nan"), "s"
        )
    for scenario in (
        "non-streaming, concurrency 1",
        "decision path alone (do-nothing upstream), concurrency 1",
    ):
        row(
            "added p50 at concurrency 1 <= 0.5 ms",
            scenario,
            lambda st, n: _added(st, n, "latencies"),
            0.5,
            "ms",
        )
    for scenario in ("streaming, concurrency 1", "streaming"):
        row(
            "added streamed TTFT p50 (reused connections) < 1 ms",
            scenario,
            lambda st, n: _added(st, n, "ttfts"),
            1.0,
            "ms",
        )
    head = [
        "",
        "**Issue 14's goals in this run** (Tandem's default path for an aggregated mesh is ext_authz; the verdict is "
        "for it):",
        "",
        "| goal | scenario | tandem (ext_authz) | tandem ext_proc | best peer | verdict |",
        "|---|---|---:|---:|---:|---|",
    ]
    return "\n".join(head + rows)


def verdicts_24(results: dict[str, dict[str, PathStats]]) -> str:
    """Issue 24's per-request goals against this run, for Tandem's default policy (kv_affinity) on its default path."""
    name = "tandem kv_affinity"
    rows = []
    plain = results.get("non-streaming", {})
    serial = results.get("non-streaming, concurrency 1", {})
    if name in plain:
        s = plain[name]
        router = _cpu(s)
        best = min((_cpu(plain[n]) for n in plain if n in PEERS), default=float("nan"))
        rows.append(
            f"| Envoy + coordinator + conductor <= 2x the best peer's whole router (CPU s / 1k requests) | "
            f"{router:.2f} | {2 * best:.2f} (2 x {best:.2f}) | {'met' if router <= 2 * best else 'not met'} |"
        )
        whole = (s.cpu_s + s.agent_s) / len(s.latencies) * 1000 if s.latencies else float("nan")
        rows.append(
            f"| the whole mesh, node agent included, <= 1.0 CPU s / 1k requests | {whole:.2f} | 1.00 | "
            f"{'met' if whole <= 1.0 else 'not met'} |"
        )
    if name in serial:
        added = _added(serial, name, "latencies")
        rows.append(
            f"| added p50 <= +1 ms at concurrency 1 | {added:+.2f} | +1.00 | {'met' if added <= 1.0 else 'not met'} |"
        )
    head = [
        "",
        "**Issue 24's goals in this run** (non-streaming, Tandem's default policy `kv_affinity`; components speak plain "
        "text here, as the peers do: mutual TLS adds its own cost, measured by `bench.mtls`):",
        "",
        "| goal | tandem | bar | verdict |",
        "|---|---:|---:|---|",
    ]
    return "\n".join(head + rows) if rows else ""


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
        nan = float("nan")
        added = [(st[n].pct(st[n].latencies, 50) - base) * 1e3 if n in st else nan for n in names]
        cpu = [st[n].cpu_s / max(len(st[n].latencies), 1) * 1000 if n in st else nan for n in names]
        axes[0].bar(xs, added, width, label=sc)
        axes[1].bar(xs, cpu, width, label=sc)
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
    parser.add_argument("--requests", type=int, default=1500, help="requests per path and scenario")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--serial-requests", type=int, default=200, help="requests per path at concurrency 1")
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
    parser.add_argument(
        "--idle-s",
        type=float,
        default=30.0,
        help="CPU of the mesh with no requests over this long first (0: not)",
    )
    parser.add_argument("--output", help="also write the tables (markdown) to this file")
    parser.add_argument("--plot", help="write a PNG plot to this file")
    args = parser.parse_args(argv)
    if not args.scenarios:
        args.scenarios = [s for s in SCENARIOS if SCENARIOS[s][0] or not args.stream]

    from tqdm import tqdm

    args.load_start = os.getloadavg()[0]
    bench = Bench(args)
    counts = [getattr(args, SCENARIOS[s][3]) // args.rounds * args.rounds for s in args.scenarios]
    total = sum(counts) * len(args.paths)
    try:
        paths = bench.start()
        for p in paths:
            for upstream, urls in p.urls.items():
                model = NULL_MODEL if upstream == "null" else "tandem-sim"
                warm = {"model": model, "prompt": "warm up", "max_tokens": 2}
                asyncio.run(run_round(urls, 50, 8, warm, PathStats(), False, False))
        with tqdm(total=total, desc="overhead", unit="req", file=sys.stderr) as bar:
            results = bench.measure(paths, bar.update)
    finally:
        bench.stop()
    args.load_end = os.getloadavg()[0]
    text = tables(results, args) + "\n" + verdicts(results) + "\n" + verdicts_24(results)
    if bench.idle is not None:
        text += "\n\n" + idle_table(bench.idle)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    if args.plot:
        plot(results, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
