"""P/D modes side by side: prefill-first handoff and decode-first trigger on the same simulated engines and trace.

    python -m bench.pd [--requests 120] [--speedup 5] [--output docs/bench/pd.md]

Each mode gets a fresh mesh of two prefill and one decode simengine (handoff: NixlConnector; trigger:
MooncakeLayerwiseConnector), `kv_affinity`, and replays the same seeded slice of the Mooncake conversation trace
through Envoy. Printed: TTFT p50/p90/p99/mean per mode (simulated ms), and for trigger mode the callback path the
coordinator measures, from the decode request leaving it to the prefill leg going out (decode engine allocation,
metaserver POST through Envoy's JSON transcoding, callback handling), p50/p99 from its histogram (wall ms).
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
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import mesh_config
from bench.replay import replay
from bench.trace import load_trace
from mesh.config import parse_mesh_config
from mesh.up import Mesh
from tandem.tokenizer import load_tokenizer
from tandem.version import __version__

MODES = {"handoff": ("prefill_handoff_decode", "NixlConnector"),
         "trigger": ("concurrent_engine_sync", "MooncakeLayerwiseConnector")}  # fmt: skip
CALLBACK = "tandem_coordinator_trigger_callback_path_seconds"


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Quantile from cumulative (upper bound, count) buckets, interpolated linearly inside the bucket."""
    total = buckets[-1][1]
    if not total:
        return float("nan")
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            share = (rank - prev_count) / (count - prev_count) if count > prev_count else 1.0
            return prev_bound + (bound - prev_bound) * share
        prev_bound, prev_count = bound, count
    return prev_bound


def callback_buckets(metrics_address: str) -> list[tuple[float, float]]:
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == CALLBACK + "_bucket":
                out.append((float(s.labels["le"]), s.value))
    return sorted(out)


def run_mode(mode: str, args, requests, workdir: Path):
    pd_mode, connector = MODES[mode]
    config = mesh_config(engines=3, engine_args=["--speedup", str(args.speedup)], policy="kv_affinity")
    roles = [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")]
    for engine, (iid, role) in zip(config["node_agents"][0]["engines"], roles, strict=True):
        engine.update(instance_id=iid, role=role, kv_connector=connector)
    config["coordinator"]["pd_mode"] = pd_mode
    config["envoy"]["log_level"] = "error"
    path = workdir / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(config))
    mesh = Mesh(parse_mesh_config(config, str(path)), str(path), workdir / f"run-{mode}")
    try:
        mesh.start()
        missing = mesh.wait_for_engines(60)
        if missing:
            raise RuntimeError(f"engines not healthy: {missing}")
        url = f"http://{config['envoy']['http_listen']}/v1/completions"
        result = asyncio.run(replay(url, "tandem-sim", requests))
        buckets = callback_buckets(config["coordinator"]["metrics_listen"]) if mode == "trigger" else []
    finally:
        mesh.stop()
    return result, buckets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default="conversation")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--time-scale", type=float, default=2.0, help="arrivals compressed by this factor")
    parser.add_argument("--speedup", type=float, default=5.0, help="simengine --speedup")
    parser.add_argument("--max-input", type=int, default=4096)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="also write the markdown table here")
    args = parser.parse_args(argv)

    requests = load_trace(args.trace, args.requests, args.time_scale, load_tokenizer(None), args.seed,
                          args.max_input, args.max_output)  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="tandem-pd-"))
    k = args.speedup * 1000  # wall seconds -> simulated ms
    rows, callback = [], []
    for mode in MODES:
        print(f"P/D mode {mode}: replaying {len(requests)} requests", file=sys.stderr, flush=True)
        result, buckets = run_mode(mode, args, requests, workdir)
        t = result.ttft_s
        mean = statistics.fmean(t) * k if t else float("nan")
        rows.append(f"| {mode} | {result.pct(t, 50) * k:.0f} | {result.pct(t, 90) * k:.0f} | "
                    f"{result.pct(t, 99) * k:.0f} | {mean:.0f} | {result.errors} |")  # fmt: skip
        if buckets:
            callback = [histogram_quantile(buckets, q) * 1000 for q in (0.5, 0.99)] + [buckets[-1][1]]
    lines = [
        f"P/D modes: {args.trace} trace, first {len(requests)} requests (inputs <= {args.max_input} tokens, outputs "
        f"<= {args.max_output}), arrivals / {args.time_scale:g}, 2 prefill + 1 decode simengine (speedup "
        f"{args.speedup:g}), kv_affinity; tandem {__version__}, {platform.machine()} {os.cpu_count()} cores. "
        "TTFT in simulated ms.",
        "",
        "| mode | TTFT p50 | p90 | p99 | mean | errors |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Trigger callback path (decode request out to prefill leg out, wall ms, from the coordinator's histogram): "
        + (
            f"p50 {callback[0]:.2f}, p99 {callback[1]:.2f} over {callback[2]:.0f} callbacks."
            if callback
            else "none."
        ),
    ]
    table = "\n".join(lines)
    print(table)
    if args.output:
        Path(args.output).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
