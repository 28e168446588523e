"""Policy comparison: a Mooncake trace replayed through the real mesh with simulated engines, per policy, and
through the peer routers (`sglang-router`, `vllm-router`) in their cache-aware modes on the same engines.

    python -m bench.policies [--trace conversation] [--requests 300] [--engines 4] [--rate 1.25] [--speedup 10]
                             [--load 0.9] [--repeats 3] [--policies kv_affinity "sglang-router cache_aware" ...]

Every row gets a fresh mesh (same engines, same empty caches, same seeded trace), so the rows differ only by the
router. Load: arrivals are compressed `--rate` times in simulated time (the engines run `--speedup` times faster
than their profile, so wall-clock arrivals are compressed `rate * speedup` times). Printed per row: TTFT
p50/p90/p99 and mean (simulated ms), the share of requests within the TTFT SLO, output tokens/s (simulated), and
the engines' prefix-cache hit rate (`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`).

`--trace` also takes a generated workload (`tenants_rag`, `sessions_agents`, made with `--seed`); `--load L` sets
the rate instead, as the fleet simulator's routing table does (L times round robin's prefill capacity with
unbounded caches, for `--engines` engines). `--repeats N` replays every row N times, rows interleaved (A B C A B
C ...), each in a fresh mesh, and adds the mean of the runs with half their range.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.engines import engine_counters, prefix_totals
from bench.harness import mesh_config
from bench.peers import PEERS, start_peer
from bench.replay import ReplayResult, replay
from bench.trace import load_trace
from mesh.config import parse_mesh_config
from mesh.up import Mesh
from tandem.tokenizer import load_tokenizer
from tandem.version import __version__


def scheduler_sections() -> dict[str, dict]:
    """(label -> coordinator scheduler section): Tandem's policies, peers' re-implementations included."""
    return {
        "round_robin": {"policy": "round_robin"},
        "least_load": {"policy": "least_load"},
        "sglang_cache_aware": {"policy": "sglang_cache_aware"},
        "llm_d": {"policy": "llm_d"},
        "dynamo": {"policy": "dynamo"},
        "kv_affinity": {"policy": "kv_affinity"},
    }


PEER_ROWS = ["sglang-router cache_aware", "vllm-router cache_aware"]
ALL_ROWS = [*scheduler_sections(), *PEER_ROWS]


@dataclass
class Row:
    """One router's replay."""

    label: str
    result: ReplayResult
    hit_rate: float
    fallbacks: float = 0.0  # requests the coordinator scored on load alone (conductor Match timed out)
    observed: Any = None  # what `run_row`'s `observe` read of the mesh after the replay


def run_row(
    label: str,
    args,
    requests,
    workdir: Path,
    progress=None,
    extra_engine_args: Sequence[str] = (),
    coordinator: Mapping[str, Any] | None = None,
    observe: Callable[[Mesh, dict, list[str], ReplayResult], Any] | None = None,
) -> Row:
    """One fresh mesh (and peer router for a peer row), one replay. `extra_engine_args` go to every engine,
    `coordinator` into the coordinator's section; `observe(mesh, config, engine addresses, result)` runs after the
    replay while the mesh is still up (its answer in `Row.observed`)."""
    engine_args = ["--speedup", str(args.speedup), "--npu-blocks", str(args.npu_blocks), *extra_engine_args]
    config = mesh_config(engines=args.engines, engine_args=engine_args)
    config["coordinator"].update(coordinator or {})
    sections = scheduler_sections()
    if label in sections:
        config["coordinator"]["scheduler"] = sections[label]
    config["envoy"]["log_level"] = "error"
    if args.match_timeout_ms:
        config["coordinator"]["scheduler"]["match_timeout_ms"] = args.match_timeout_ms
    slug = label.replace(" ", "-")
    path = workdir / f"{slug}.yaml"
    path.write_text(yaml.safe_dump(config))
    mesh = Mesh(parse_mesh_config(config, str(path)), str(path), workdir / f"run-{slug}")
    engines = [f"127.0.0.1:{e['port']}" for e in config["node_agents"][0]["engines"]]
    peer = None
    try:
        mesh.start()
        missing = mesh.wait_for_engines(60)
        if missing:
            raise RuntimeError(f"engines not healthy: {missing}")
        if label in PEERS:
            peer = start_peer(label, engines, workdir)
            url = f"{peer.url}/v1/completions"
        else:
            url = f"http://{config['envoy']['http_listen']}/v1/completions"
        q0, h0 = prefix_totals(engines)
        result = asyncio.run(replay(url, "tandem-sim", requests, progress))
        q1, h1 = prefix_totals(engines)
        fallbacks = 0.0
        if peer is None:
            name = "tandem_coordinator_match_fallbacks_total"
            fallbacks = engine_counters(config["coordinator"]["metrics_listen"], (name,))[name]
        observed = observe(mesh, config, engines, result) if observe is not None else None
    finally:
        if peer is not None:
            peer.stop()
        mesh.stop()
    return Row(label, result, (h1 - h0) / (q1 - q0) if q1 > q0 else float("nan"), fallbacks, observed)


def run_row_isolated(label: str, args, requests, workdir: Path) -> Row:
    """`run_row` in a fresh interpreter, so that no row inherits another's client state (a kv_affinity mesh started
    second by one process once measured 16-25% slower, 2026-12-02; three runs on 2026-12-07 no longer did)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_row, label, args, requests, workdir).result()


def plot(rows: list[Row], speedup: float, path: Path) -> None:
    """TTFT p50/p90/p99 per row as grouped bars (simulated ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.27
    for i, q in enumerate((50, 90, 99)):
        values = [r.result.pct(r.result.ttft_s, q) * speedup * 1000 for r in rows]
        ax.bar([x + (i - 1) * width for x in range(len(rows))], values, width, label=f"p{q}")
    ax.set_xticks(range(len(rows)), [r.label.replace(" ", "\n") for r in rows], fontsize=8)
    ax.set_ylabel("TTFT (simulated ms)")
    ax.set_title("TTFT per router, same engines and trace")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[Row], args, n_requests: int) -> str:
    """The markdown table with its caption."""
    k = args.speedup * 1000
    lines = [
        f"Trace replay: {args.trace} trace, first {n_requests} requests (inputs <= {args.max_input} tokens, "
        f"outputs <= {args.max_output}), arrivals x{args.rate:g} in simulated time, {args.engines} simengine "
        f"engines (ascend-910b profile, speedup {args.speedup:g}, {args.npu_blocks} NPU blocks of 16 tokens), "
        f"seed {args.seed}. TTFT in simulated ms; SLO {args.ttft_slo_ms:g} ms. tandem {__version__}, "
        f"{platform.machine()} {os.cpu_count()} cores.",
        "",
        "| router / policy | TTFT p50 | p90 | p99 | mean | within SLO | output tok/s | prefix hit rate | errors | Match fallbacks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        r = row.result
        mean = statistics.fmean(r.ttft_s) * k if r.ttft_s else float("nan")
        tps = r.output_tokens / r.wall_s / args.speedup if r.wall_s else float("nan")
        lines.append(
            f"| {row.label} | {r.pct(r.ttft_s, 50) * k:.0f} | {r.pct(r.ttft_s, 90) * k:.0f} "
            f"| {r.pct(r.ttft_s, 99) * k:.0f} | {mean:.0f} | {r.slo_share(args.ttft_slo_ms / k):.0%} "
            f"| {tps:.0f} | {row.hit_rate:.1%} | {r.errors} | {row.fallbacks:.0f} |"
        )
    return "\n".join(lines)


def load_rate(args) -> float:
    """The simulated-time arrival compression at which the trace's prefill reaches `args.load` times round robin's
    prefill capacity (the fleet simulator's routing table's load level)."""
    from bench.fleet.instance import EngineSpec
    from bench.fleet.routing import Cell, cell_arrivals

    cell = Cell(args.trace, args.engines, args.load, args.seed)
    engine = EngineSpec(npu_blocks=args.npu_blocks)
    ids = load_tokenizer(None).word_ids
    _, scale, _ = cell_arrivals(cell, args.requests, 0, engine, ids, args.max_input, args.max_output)
    return scale


def _by_label(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for row in rows:
        out.setdefault(row.label, []).append(row)
    return out


def _mean_p99(rows: list[Row]) -> tuple[float, float]:
    """Mean over runs of each run's mean and p99 TTFT (simulated seconds over the speedup)."""
    done = [r.result for r in rows if r.result.ttft_s]
    return (
        statistics.fmean(statistics.fmean(r.ttft_s) for r in done) if done else float("nan"),
        statistics.fmean(r.pct(r.ttft_s, 99) for r in done) if done else float("nan"),
    )


def spread_table(rows: list[Row], speedup: float) -> str:
    """Per row, the mean over its runs with half their range: TTFT mean, p99 (simulated ms), hit rate."""
    k = speedup * 1000

    def spread(values: list[float], scale: float, fmt: str) -> str:
        mean = statistics.fmean(values) * scale
        return f"{mean:{fmt}} ±{(max(values) - min(values)) * scale / 2:{fmt}}"

    lines = [
        "| router / policy | runs | TTFT mean | p99 | prefix hit rate (%) |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, runs in _by_label(rows).items():
        done = [r for r in runs if r.result.ttft_s]
        if not done:
            continue
        means = [statistics.fmean(r.result.ttft_s) for r in done]
        p99s = [r.result.pct(r.result.ttft_s, 99) for r in done]
        lines.append(
            f"| {label} | {len(done)} | {spread(means, k, '.0f')} | {spread(p99s, k, '.0f')} "
            f"| {spread([r.hit_rate for r in done], 100, '.1f')} |"
        )
    return "\n".join(lines)


def verdict(rows: list[Row]) -> str:
    """Whether kv_affinity (Tandem's default) beats every other row on mean and p99 TTFT (means over runs)."""
    by = {label: _mean_p99(runs) for label, runs in _by_label(rows).items()}
    ours = by.get("kv_affinity")
    if ours is None:
        return ""
    mean_t, p99_t = ours
    lost = [
        label
        for label, (mean, p99) in by.items()
        if label != "kv_affinity" and (mean <= mean_t or p99 <= p99_t)
    ]
    if not lost:
        return "kv_affinity has the lowest mean and p99 TTFT of every peer policy and peer router here."
    return (
        "kv_affinity does not beat every peer on both mean and p99 TTFT here; as good or better on at least "
        f"one of the two: {', '.join(lost)}."
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        default="conversation",
        help="conversation, synthetic, a path, tenants_rag or sessions_agents",
    )
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=1.25, help="arrival compression in simulated time")
    parser.add_argument(
        "--time-scale",
        type=float,
        help="wall-clock arrival compression (overrides --rate: rate = it / speedup)",
    )
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--speedup", type=float, default=10.0, help="simengine --speedup")
    parser.add_argument("--npu-blocks", type=int, default=16384, help="KV blocks per engine (16 tokens each)")
    parser.add_argument("--max-input", type=int, default=8192, help="cap prompt tokens (0: none)")
    parser.add_argument("--max-output", type=int, default=64, help="cap output tokens (0: none)")
    parser.add_argument("--ttft-slo-ms", type=float, default=3000.0, help="TTFT SLO, in simulated time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--load", type=float, default=0.0, help="arrival rate as a share of round robin's prefill capacity"
    )
    parser.add_argument("--repeats", type=int, default=1, help="replays of every row (interleaved)")
    parser.add_argument(
        "--match-timeout-ms",
        type=float,
        default=0,
        help="coordinator's conductor Match deadline (0: default)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    parser.add_argument("--policies", nargs="+", default=ALL_ROWS, choices=ALL_ROWS, metavar="ROW")
    parser.add_argument("--output-dir", help="write policies.md and policies.png here")
    args = parser.parse_args(argv)
    if args.time_scale:
        args.rate = args.time_scale / args.speedup
    if args.load:
        args.rate = load_rate(args)

    from tqdm import tqdm

    requests = load_trace(
        args.trace,
        args.requests,
        args.rate * args.speedup,
        load_tokenizer(None),
        args.seed,
        args.max_input,
        args.max_output,
    )
    workdir = Path(tempfile.mkdtemp(prefix="tandem-policies-"))
    rows = []
    runs = [label for _ in range(args.repeats) for label in args.policies]
    with tqdm(runs, desc="policies", unit="row", file=sys.stderr) as bar:
        for label in bar:
            bar.set_postfix_str(label)
            rows.append(run_row_isolated(label, args, requests, workdir))
    text = table(rows, args, len(requests))
    if args.repeats > 1:
        text += "\n\n" + spread_table(rows, args.speedup)
    text += "\n\n" + verdict(rows)
    print(text)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "policies.md").write_text(text + "\n")
        plot(rows, args.speedup, out / "policies.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
