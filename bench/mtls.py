"""What mutual TLS between components costs per request: two identical meshes, one with certificates (the
default) and one with `security.insecure: true`, measured side by side in one run.

    python -m bench.mtls [--requests 2000] [--concurrency 32] [--engines 2] [--rounds 4]

The client talks plain HTTP to Envoy's ingress in both (the public port is the same); what differs is Envoy's
ext_proc stream to the coordinator, the coordinator's Match stream to the conductor and the agents' links, which
are mutual TLS in one mesh and plain text in the other. The meshes take turns in `--rounds` rounds so both see
the same machine state. Printed: requests/s, latency p50/p99 and CPU seconds per 1,000 requests of Envoy +
coordinator + conductor (from /proc), and the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
from pathlib import Path

import yaml

from bench.harness import mesh_config
from bench.overhead import PathStats, cpu_seconds, run_round
from mesh.config import parse_mesh_config
from mesh.up import Mesh
from tandem.version import __version__

MODES = ("plain text", "mTLS")


def start_mesh(mode: str, args, workdir: Path) -> tuple[Mesh, str, dict[str, int]]:
    config = mesh_config(engines=args.engines, engine_args=["--speedup", str(args.speedup)])
    config["envoy"]["log_level"] = "error"
    if mode == "plain text":
        config["security"] = {"insecure": True}
    path = workdir / f"{mode.replace(' ', '-')}.yaml"
    path.write_text(yaml.safe_dump(config))
    mesh = Mesh(parse_mesh_config(config, str(path)), str(path), workdir / f"run-{mode.replace(' ', '-')}")
    mesh.start()
    missing = mesh.wait_for_engines(60)
    if missing:
        mesh.stop()
        raise RuntimeError(f"{mode}: engines not healthy: {missing}")
    pids = {c.name: c.process.pid for c in mesh.components if c.name in ("envoy", "coordinator", "conductor")}
    return mesh, f"http://{config['envoy']['http_listen']}/v1/completions", pids


def measure(urls: dict[str, tuple[str, dict[str, int]]], args) -> dict[str, PathStats]:
    body = {"model": "tandem-sim", "prompt": "Benchmark prompt " * 20, "max_tokens": args.max_tokens}
    stats = {mode: PathStats() for mode in urls}
    per_round = args.requests // args.rounds
    for r in range(args.rounds):
        order = list(urls) if r % 2 == 0 else list(reversed(urls))  # neither always goes first
        for mode in order:
            url, pids = urls[mode]
            before = {n: cpu_seconds(pid) for n, pid in pids.items()}
            asyncio.run(run_round([url], per_round, args.concurrency, body, stats[mode], False, False))
            for n, pid in pids.items():
                used = cpu_seconds(pid) - before[n]
                stats[mode].cpu_s += used
                stats[mode].cpu_by[n] = stats[mode].cpu_by.get(n, 0.0) + used
    return stats


def table(stats: dict[str, PathStats], args) -> str:
    lines = [
        f"mTLS cost: {args.requests} non-streaming requests per mesh in {args.rounds} alternating rounds, "
        f"concurrency {args.concurrency}, {args.engines} simengine engines per mesh (speedup {args.speedup:g}, "
        f"max_tokens {args.max_tokens}); tandem {__version__}; {platform.machine()} {os.cpu_count()} cores, "
        f"Python {platform.python_version()}. Latencies in ms; CPU of Envoy + coordinator + conductor.",
        "",
        "| components talk | ok / errors | req/s | p50 | p99 | CPU s / 1k req |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for mode, s in stats.items():
        n = max(len(s.latencies), 1)
        parts = ", ".join(f"{name} {v / n * 1000:.2f}" for name, v in sorted(s.cpu_by.items()))
        lines.append(
            f"| {mode} | {len(s.latencies)} / {s.errors} | {s.rps:.0f} | {s.pct(s.latencies, 50) * 1e3:.2f} "
            f"| {s.pct(s.latencies, 99) * 1e3:.2f} | {s.cpu_s / n * 1000:.2f} ({parts}) |"
        )
    plain, tls = stats["plain text"], stats["mTLS"]
    if plain.latencies and tls.latencies:
        lines += [
            "",
            f"mTLS minus plain text: p50 {(tls.pct(tls.latencies, 50) - plain.pct(plain.latencies, 50)) * 1e3:+.2f} ms, "
            f"p99 {(tls.pct(tls.latencies, 99) - plain.pct(plain.latencies, 99)) * 1e3:+.2f} ms, CPU "
            f"{(tls.cpu_s / len(tls.latencies) - plain.cpu_s / len(plain.latencies)) * 1000:+.2f} s per 1k requests.",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests per mesh")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--engines", type=int, default=2, help="engines per mesh")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--speedup", type=float, default=10.0, help="simengine --speedup")
    parser.add_argument("--output", help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="tandem-mtls-"))
    meshes: list[Mesh] = []
    try:
        urls = {}
        for mode in MODES:
            mesh, url, pids = start_mesh(mode, args, workdir)
            meshes.append(mesh)
            urls[mode] = (url, pids)
        text = table(measure(urls, args), args)
    finally:
        for mesh in meshes:
            mesh.stop()
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
