"""Policy comparison: a Mooncake trace replayed through the real mesh with simulated engines, per policy.

    python -m bench.policies [--trace conversation] [--requests 200] [--engines 4] [--speedup 8] ...

Every policy gets a fresh mesh (same engines, same empty caches, same seeded trace), so the rows differ only by
the policy. Printed per policy: TTFT p50/p90/p99 and mean, share of requests within the TTFT SLO, output tokens/s,
and the engines' prefix-cache hit rate (`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`).
Writes a markdown table and a PNG plot when `--output-dir` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from bench.engines import prefix_totals
from bench.harness import mesh_config
from bench.replay import ReplayResult, replay
from bench.trace import load_trace
from tandem.config import parse_mesh_config
from tandem.tokenizer import load_tokenizer
from tandem.up import Mesh
from tandem.version import __version__

#: (label, scheduler section): the peers' policies with their defaults, and Tandem's.
POLICIES: dict[str, dict] = {
    "round_robin": {"policy": "round_robin"},
    "least_load": {"policy": "least_load"},
    "sglang_cache_aware": {"policy": "sglang_cache_aware"},
    "llm_d": {"policy": "llm_d"},
    "dynamo": {"policy": "dynamo"},
    "kv_affinity": {"policy": "kv_affinity"},
    "kv_affinity_tuned": {
        "policy": "kv_affinity_tuned",
        "policies": [{"name": "kv_affinity_tuned", "type": "kv_affinity", "params": {"load_weight": 0.5}}],
    },
}


def run_policy(label: str, scheduler: dict, args, requests, workdir: Path) -> tuple[ReplayResult, float]:
    """One fresh mesh, one replay; returns the result and the prefix hit rate."""
    engine_args = ["--speedup", str(args.speedup), "--npu-blocks", str(args.npu_blocks)]
    config = mesh_config(engines=args.engines, engine_args=engine_args)
    config["coordinator"]["scheduler"] = scheduler
    config["envoy"]["log_level"] = "error"
    path = workdir / f"{label}.yaml"
    path.write_text(yaml.safe_dump(config))
    mesh = Mesh(parse_mesh_config(config, str(path)), str(path), workdir / f"run-{label}")
    engines = [f"127.0.0.1:{e['port']}" for e in config["node_agents"][0]["engines"]]
    try:
        mesh.start()
        missing = mesh.wait_for_engines(60)
        if missing:
            raise RuntimeError(f"engines not healthy: {missing}")
        q0, h0 = prefix_totals(engines)
        url = f"http://{config['envoy']['http_listen']}/v1/completions"
        result = asyncio.run(replay(url, "tandem-sim", requests))
        q1, h1 = prefix_totals(engines)
    finally:
        mesh.stop()
    return result, (h1 - h0) / (q1 - q0) if q1 > q0 else float("nan")


def plot(rows: list[tuple[str, ReplayResult, float]], path: Path) -> None:
    """TTFT p50/p90/p99 per policy as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.27
    for i, q in enumerate((50, 90, 99)):
        values = [r[1].pct(r[1].ttft_s, q) * 1000 for r in rows]
        ax.bar([x + (i - 1) * width for x in range(len(rows))], values, width, label=f"p{q}")
    ax.set_xticks(range(len(rows)), labels, rotation=20)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT per policy, same engines and trace")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default="conversation", help="conversation, synthetic, or a path")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--time-scale", type=float, default=8.0, help="arrivals compressed by this factor")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=8.0, help="simengine --speedup (match --time-scale)")
    parser.add_argument("--npu-blocks", type=int, default=2048, help="KV blocks per engine (16 tokens each)")
    parser.add_argument("--max-input", type=int, default=8192, help="cap prompt tokens (0: none)")
    parser.add_argument("--max-output", type=int, default=64, help="cap output tokens (0: none)")
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="TTFT SLO, in simulated time")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", help="write policies.md and policies.png here")
    args = parser.parse_args(argv)

    vocab = load_tokenizer(None).vocab_size
    requests = load_trace(
        args.trace, args.requests, args.time_scale, vocab, args.seed, args.max_input, args.max_output
    )
    workdir = Path(tempfile.mkdtemp(prefix="tandem-policies-"))
    rows = []
    for label in args.policies:
        print(f"policy {label}: replaying {len(requests)} requests", file=sys.stderr, flush=True)
        result, hit_rate = run_policy(label, POLICIES[label], args, requests, workdir)
        rows.append((label, result, hit_rate))

    # TTFTs are measured in wall time; the engines run `speedup` times faster than the profile, so simulated
    # time is wall time * speedup.
    k = args.speedup * 1000
    lines = [
        f"Policy comparison: {args.trace} trace, first {len(requests)} requests (inputs <= {args.max_input} tokens, "
        f"outputs <= {args.max_output}), arrivals / {args.time_scale:g}, {args.engines} simengine engines "
        f"(speedup {args.speedup:g}, {args.npu_blocks} NPU blocks each). TTFT in simulated ms. tandem {__version__}, "
        f"{platform.machine()} {os.cpu_count()} cores.",
        "",
        "| policy | TTFT p50 | p90 | p99 | mean | within SLO | output tok/s | prefix hit rate | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r, hit in rows:
        mean = statistics.fmean(r.ttft_s) * k if r.ttft_s else float("nan")
        lines.append(
            f"| {label} | {r.pct(r.ttft_s, 50) * k:.0f} | {r.pct(r.ttft_s, 90) * k:.0f} | {r.pct(r.ttft_s, 99) * k:.0f} "
            f"| {mean:.0f} | {r.slo_share(args.ttft_slo_ms / k):.0%} | {r.output_tokens / r.wall_s / args.speedup:.0f} "
            f"| {hit:.1%} | {r.errors} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "policies.md").write_text(table + "\n")
        plot(rows, out / "policies.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
