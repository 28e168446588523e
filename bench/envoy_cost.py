"""What each part of Envoy's path costs: the mesh's own Envoy configuration against itself with one part taken out
at a time, down to a plain proxy (issue 24: "find which filters and access-log settings cost what by measuring
them one at a time against the prototype path").

    python -m bench.envoy_cost [--requests 3000] [--rounds 3] [--concurrency 32] [--output FILE]

One mesh as `bench.overhead` runs it (`tandem up`, plain text between components), its simulated engines and the
do-nothing upstream registered as a second model. Each variant is an Envoy of its own (one worker thread, as
`tandem up` runs it), rendered from the mesh's configuration with one part changed:

- `mesh`: the configuration `tandem up` renders: the ext_authz Check with the body, ORIGINAL_DST to the engine the
  coordinator names, the gRPC access log the coordinator learns request ends from, and the guards (connection
  limit filter, overload manager, the listener's first-byte inspector, OpenAI-shaped local replies);
- `no access log`: the same without the access log (a mesh needs it; here only to measure it);
- `no guards`: the same without the guards;
- `no decision retry`: the same without the retry policy of the decision call (Envoy keeps a copy of each Check
  to send again while the coordinator restarts);
- `decision, static route`: the decision kept, but requests go round robin over a static cluster of the upstream
  (chosen by a header the load generator sets) instead of to the engine the decision names (ORIGINAL_DST);
- `no decision`: without ext_authz; requests go round robin over a static cluster of the upstream (chosen by a
  header the load generator sets), the access log and the guards kept;
- `plain proxy`: no decision, no access log, no guards: the floor (the prototypes this design started from measured
  a plain Envoy with static round robin at 0.055 CPU s per 1,000 requests, concurrency 32, instant upstreams).

Variants take turns in `--rounds` rounds, each sending `--requests / --rounds` non-streaming requests to each
upstream at `--rate` per second, open loop, so that every variant does the same work per second (with `--rate 0`,
closed loop at `--concurrency`: a faster variant then wakes less often per request, which lowers its CPU per
request). Envoy's own CPU (from /proc) per 1,000 requests: the median of the rounds, with
their range. What a part costs is the difference between two rows measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.harness import envoy_version
from bench.overhead import NULL_MODEL, Bench, PathStats, cpu_seconds, one_request, run_round
from tandem.version import __version__

VARIANTS = (
    "mesh", "no access log", "no guards", "no decision retry", "decision, static route", "no decision", "plain proxy",
)  # fmt: skip
UPSTREAMS = {"engines": "tandem-sim", "null": NULL_MODEL}  # upstream -> model the body names
#: The header the load generator sets so that the variants without a decision pick the upstream's cluster.
UPSTREAM_HEADER = "x-bench-upstream"


def _ingress(config: dict) -> tuple[dict, dict]:
    """The ingress listener and its HTTP connection manager's typed config."""
    listener = next(x for x in config["static_resources"]["listeners"] if x["name"] == "ingress")
    hcm = next(
        f for f in listener["filter_chains"][0]["filters"] if f["name"].endswith("http_connection_manager")
    )
    return listener, hcm["typed_config"]


def _static_cluster(config: dict, name: str, addresses: list[str]) -> dict:
    """The engines cluster's connection settings, with fixed endpoints balanced round robin."""
    cluster = copy.deepcopy(next(c for c in config["static_resources"]["clusters"] if c["name"] == "engines"))
    cluster.pop("original_dst_lb_config", None)
    endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}
        for host, port in (a.rsplit(":", 1) for a in addresses)
    ]
    cluster.update(
        name=name,
        type="STATIC",
        lb_policy="ROUND_ROBIN",
        load_assignment={"cluster_name": name, "endpoints": [{"lb_endpoints": endpoints}]},
    )
    return cluster


def variant(config: dict, name: str, upstreams: dict[str, list[str]]) -> dict:
    """The rendered configuration `config` changed as the variant `name` says (module docstring); a new dict."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})")
    out = copy.deepcopy(config)
    listener, hcm = _ingress(out)
    if name in ("no access log", "plain proxy"):
        hcm.pop("access_log", None)
    if name in ("no guards", "plain proxy"):
        out.pop("overload_manager", None)
        chain = listener["filter_chains"][0]
        chain["filters"] = [f for f in chain["filters"] if f["name"].endswith("http_connection_manager")]
        for key in ("listener_filters", "listener_filters_timeout", "continue_on_listener_filters_timeout"):
            listener.pop(key, None)
        hcm.pop("local_reply_config", None)
    if name == "no decision retry":
        authz = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_authz")
        authz["typed_config"]["grpc_service"].pop("retry_policy", None)
    if name in ("no decision", "plain proxy"):
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.router"]
    if name in ("decision, static route", "no decision", "plain proxy"):
        routes = [
            {
                "match": {
                    "prefix": "/",
                    "headers": [{"name": UPSTREAM_HEADER, "string_match": {"exact": up}}],
                },
                "route": {"cluster": f"bench_{up}", "timeout": "0s"},
            }
            for up in upstreams
        ]
        hcm["route_config"] = {
            "name": "bench",
            "virtual_hosts": [{"name": "bench", "domains": ["*"], "routes": routes}],
        }
        out["static_resources"]["clusters"] += [
            _static_cluster(config, f"bench_{up}", a) for up, a in upstreams.items()
        ]
    return out


@dataclass
class Row:
    """One variant in front of one upstream, over every round."""

    stats: PathStats = field(default_factory=PathStats)
    cpu_per_1k: list[float] = field(default_factory=list)  # Envoy CPU s per 1,000 requests, per round


class EnvoyCost:
    """The mesh, its upstreams and one Envoy per variant."""

    def __init__(self, args) -> None:
        self.args = args
        bench_args = argparse.Namespace(engines=args.engines, speedup=args.speedup, idle_s=0, paths=[])
        self.bench = Bench(bench_args)
        self.envoys: dict[str, tuple[str, int]] = {}  # variant -> (URL, pid)

    def start(self) -> None:
        self.bench.start()
        nulls = [i.address for i in self.bench.registrars[0].instances]
        engines = [f"127.0.0.1:{e['port']}" for e in self.bench.config["node_agents"][0]["engines"]]
        upstreams = {"engines": engines, "null": nulls}
        for name in self.args.variants:
            slug = name.replace(" ", "-").replace(",", "")
            self.envoys[name] = self.bench.second_envoy(slug, lambda c, n=name: variant(c, n, upstreams))

    def stop(self) -> None:
        self.bench.stop()

    def measure(self, progress=None) -> dict[tuple[str, str], Row]:
        a = self.args
        rows = {(v, up): Row() for v in a.variants for up in UPSTREAMS}
        per_round = a.requests // a.rounds
        for v in a.variants:  # warm up: connections, the ORIGINAL_DST hosts, the decision's first calls
            for up, model in UPSTREAMS.items():
                self._run(v, up, model, 50, PathStats())
        for _ in range(a.rounds):
            for v in a.variants:
                for up, model in UPSTREAMS.items():
                    row = rows[v, up]
                    before = cpu_seconds(self.envoys[v][1])
                    done = len(row.stats.latencies)
                    self._run(v, up, model, per_round, row.stats)
                    served = len(row.stats.latencies) - done
                    row.cpu_per_1k.append((cpu_seconds(self.envoys[v][1]) - before) / max(served, 1) * 1000)
                    if progress is not None:
                        progress(per_round)
        return rows

    def _run(self, v: str, upstream: str, model: str, count: int, stats: PathStats) -> None:
        body = {"model": model, "prompt": "Benchmark prompt " * 20, "max_tokens": self.args.max_tokens}
        url, headers, a = self.envoys[v][0], {UPSTREAM_HEADER: upstream}, self.args
        if a.rate:
            asyncio.run(open_loop(url, count, a.rate, body, stats, headers))
        else:
            asyncio.run(run_round([url], count, a.concurrency, body, stats, False, False, headers))


async def open_loop(url: str, count: int, rate: float, body: dict, stats: PathStats, headers: dict) -> None:
    """`count` requests sent at `rate` per second whatever the answers (so every variant does the same work per
    second, and its CPU per request is not a matter of how many requests each wake-up finds)."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        start = time.perf_counter()
        tasks = []
        for i in range(count):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(session, url, body, stats, False)))
        await asyncio.gather(*tasks)
        stats.busy_s += time.perf_counter() - start


def table(rows: dict[tuple[str, str], Row], args) -> str:
    lines = [
        f"Envoy's path, one part at a time: {args.requests} non-streaming requests per variant and upstream in "
        f"{args.rounds} alternating rounds, "
        + (f"{args.rate:g} per second (open loop)" if args.rate else f"at concurrency {args.concurrency}")
        + f"; {args.engines} simengine engines "
        f"(speedup {args.speedup:g}, max_tokens {args.max_tokens}) and the do-nothing upstream; Envoy "
        f"{args.envoy_version}, one worker thread; tandem {__version__}, {platform.machine()} {os.cpu_count()} "
        f"cores. Load average (1 min) at start {args.load_start:.2f}, at end {args.load_end:.2f}. Latency in ms; "
        "CPU: Envoy's own, seconds per 1,000 requests, median of the rounds (range).",
        "",
        "| variant | upstream | ok / errors | req/s | p50 | p99 | Envoy CPU s / 1k req |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (v, up), row in rows.items():
        s, cpu = row.stats, row.cpu_per_1k
        lines.append(
            f"| {v} | {up} | {len(s.latencies)} / {s.errors} | {s.rps:.0f} | {s.pct(s.latencies, 50) * 1000:.2f} "
            f"| {s.pct(s.latencies, 99) * 1000:.2f} | {statistics.median(cpu):.3f} ({min(cpu):.3f}-{max(cpu):.3f}) |"
        )
    lines += ["", "What each part costs (differences of the medians, CPU s / 1k requests):", ""]
    med = {k: statistics.median(r.cpu_per_1k) for k, r in rows.items()}
    parts = (
        ("the gRPC access log", "mesh", "no access log"),
        ("the guards", "mesh", "no guards"),
        ("the decision call's retry policy", "mesh", "no decision retry"),
        (
            "routing to the engine the decision names (ORIGINAL_DST) over a static round robin",
            "mesh",
            "decision, static route",
        ),
        ("the decision (ext_authz with the body, ORIGINAL_DST)", "mesh", "no decision"),
        ("everything over a plain proxy", "mesh", "plain proxy"),
    )
    for label, full, without in parts:
        if (full, "engines") in med and (without, "engines") in med:
            diffs = ", ".join(
                f"{up} {round(med[full, up] - med[without, up], 3) or 0.0:+.3f}" for up in UPSTREAMS
            )
            lines.append(f"- {label}: {diffs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=3000, help="requests per variant and upstream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--rate", type=float, default=400.0, help="requests per second, sent open loop (0: closed loop)"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight with --rate 0")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--speedup", type=float, default=10.0, help="simengine --speedup")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="VARIANT")
    parser.add_argument("--output", help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    args.load_start = os.getloadavg()[0]
    build = envoy_version().split("/")  # <commit>/<version>/<status>/<build type>/<TLS library>, or n/a
    args.envoy_version = build[1] if len(build) > 2 else "/".join(build)

    from tqdm import tqdm

    run = EnvoyCost(args)
    try:
        run.start()
        total = args.requests // args.rounds * args.rounds * len(args.variants) * len(UPSTREAMS)
        with tqdm(total=total, desc="envoy cost", unit="req", file=sys.stderr) as bar:
            rows = run.measure(bar.update)
    finally:
        run.stop()
    args.load_end = os.getloadavg()[0]
    text = table(rows, args)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
