"""Fleet simulator: Tandem's policies, the conductor's index and simengine's cache and timing model in virtual
time, in-process, so a whole trace replays against 8 to 512 instances in minutes.

    python -m bench.fleet rows   [--instances 4] [--rate 1.25] [--requests 300] ...   # one row per policy
    python -m bench.fleet sweep  [...]   # kv_affinity parameter grid; writes bench/tuned_kv_affinity.json
    python -m bench.fleet scale  [--sizes 8 64 512] [--base-instances 4] ...

Every figure is simulated time; the same seed gives the same figures. Decision times are wall-clock time of the
coordinator's and conductor's own Python (Match, candidate building, pick), per decision.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from bench.fleet.instance import EngineSpec
from bench.fleet.runs import (
    POLICY_ROWS,
    SWEEP_GRID,
    Workload,
    run_many,
    scale_jobs,
    score,
    sweep_jobs,
)
from bench.fleet.sim import FleetConfig, FleetResult

TUNED_FILE = Path(__file__).resolve().parents[1] / "tuned_kv_affinity.json"


def _ms(x: float) -> str:
    return f"{x * 1000:.0f}"


def row_cells(r: FleetResult, slo_s: float) -> str:
    return (
        f"{_ms(r.pct(50))} | {_ms(r.pct(90))} | {_ms(r.pct(99))} | {_ms(r.mean_ttft)} | {r.slo_share(slo_s):.0%} "
        f"| {r.output_tps:.0f} | {r.hit_rate:.1%}"
    )


def caption(args, what: str) -> str:
    return (
        f"{what}: {args.trace} trace, {args.requests} requests per copy (inputs <= {args.max_input}, outputs <= "
        f"{args.max_output}), arrivals x{args.rate:g} per copy, {args.npu_blocks} NPU blocks of 16 tokens per "
        f"engine (ascend-910b), engine load reported every {args.load_interval:g} s, seed {args.seed}. "
        "TTFT in simulated ms."
    )


def workload(args) -> Workload:
    return Workload(args.trace, args.requests, args.rate, args.max_input, args.max_output, args.seed)


def engine(args) -> EngineSpec:
    return EngineSpec(npu_blocks=args.npu_blocks)


def cmd_rows(args, progress=None) -> tuple[str, dict[str, FleetResult]]:
    rows = {**POLICY_ROWS, "kv_affinity_tuned": ("kv_affinity", tuned())}
    jobs = [
        (
            FleetConfig(args.instances, p, params, engine(args), args.load_interval),
            workload(args),
        )
        for p, params in rows.values()
    ]
    results = dict(zip(rows, run_many(jobs, args.workers, progress), strict=True))
    lines = [
        caption(args, f"Fleet simulator, {args.instances} instances"),
        "",
        "| policy | TTFT p50 | p90 | p99 | mean | within SLO | output tok/s | prefix hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {k} | {row_cells(r, args.ttft_slo_ms / 1000)} |" for k, r in results.items()),
    ]
    return "\n".join(lines), results


def tuned() -> dict:
    if TUNED_FILE.exists():
        return json.loads(TUNED_FILE.read_text())["params"]
    from bench.policies import DEFAULT_TUNED

    return dict(DEFAULT_TUNED)


def cmd_sweep(args, progress=None) -> tuple[str, dict]:
    base = FleetConfig(args.instances, "kv_affinity", None, engine(args), args.load_interval)
    grid = sweep_jobs(base, workload(args))
    peers = [(label, (replace(base, policy=p, params=params), workload(args))) for label, (p, params) in POLICY_ROWS.items()]
    results = run_many([j for _, j in grid] + [j for _, j in peers], args.workers, progress)
    swept = list(zip([p for p, _ in grid], results[: len(grid)], strict=True))
    peer_results = dict(zip([label for label, _ in peers], results[len(grid) :], strict=True))
    best_params, best = min(swept, key=lambda pr: score(pr[1]))
    others = {k: v for k, v in peer_results.items() if k != "kv_affinity"}
    beats = all(best.mean_ttft < r.mean_ttft and best.pct(99) < r.pct(99) for r in others.values())
    chosen = {"params": best_params, "score_s": round(score(best), 4), "beats_peers_in_sim": beats}
    if args.write:
        TUNED_FILE.write_text(json.dumps({**chosen, "sweep": caption(args, "sweep")}, indent=1) + "\n")
    grid_keys = ", ".join(f"`{k}` in {v}" for k, v in SWEEP_GRID.items())
    lines = [
        caption(args, f"kv_affinity sweep, {args.instances} instances")
        + f" Grid: {grid_keys} (mode blend). Ranked by mean + p99 TTFT; the five best and the peers:",
        "",
        "| kv_affinity params / policy | TTFT p50 | p90 | p99 | mean | within SLO | output tok/s | prefix hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for params, r in sorted(swept, key=lambda pr: score(pr[1]))[:5]:
        label = ", ".join(f"{k}={v}" for k, v in params.items())
        lines.append(f"| {label} | {row_cells(r, args.ttft_slo_ms / 1000)} |")
    for label, r in peer_results.items():
        lines.append(f"| {label} (default) | {row_cells(r, args.ttft_slo_ms / 1000)} |")
    lines += [
        "",
        f"Chosen for kv_affinity_tuned: `{json.dumps(best_params)}`; in the simulator it "
        + ("beats" if beats else "does not beat")
        + " every other policy on both mean and p99 TTFT.",
    ]
    return "\n".join(lines), chosen


def cmd_scale(args, progress=None) -> tuple[str, list]:
    jobs = scale_jobs(args.sizes, args.base_instances, engine(args), workload(args), tuned(), load_interval_s=args.load_interval)
    results = run_many([j for _, _, j in jobs], args.workers, progress)
    rows = [(n, label, r) for (n, label, _), r in zip(jobs, results, strict=True)]
    lines = [
        caption(args, f"Fleet scale (trace tiled: one copy per {args.base_instances} instances)"),
        "Decision time: wall-clock microseconds per request in the conductor's Match (chain hashing and index "
        "walk), building candidates (ledger lookups) and the policy's pick.",
        "",
        "| instances | policy | requests | TTFT p50 | p99 | mean | prefix hit rate | Match us | candidates us "
        "| pick us | sim wall s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, label, r in rows:
        d = r.decision_us()
        lines.append(
            f"| {n} | {label} | {len(r.ttft_s)} | {_ms(r.pct(50))} | {_ms(r.pct(99))} | {_ms(r.mean_ttft)} "
            f"| {r.hit_rate:.1%} | {d['match']:.0f} | {d['candidates']:.0f} | {d['pick']:.0f} | {r.wall_s:.1f} |"
        )
    return "\n".join(lines), rows


def plot_scale(rows, path: Path) -> None:
    """Mean TTFT, hit rate and decision time per policy against fleet size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for _, label, _ in rows))
    sizes = sorted({n for n, _, _ in rows})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label in labels:
        pts = sorted((n, r) for n, lab, r in rows if lab == label)
        xs = [n for n, _ in pts]
        axes[0].plot(xs, [r.mean_ttft * 1000 for _, r in pts], marker="o", label=label)
        axes[1].plot(xs, [r.hit_rate * 100 for _, r in pts], marker="o", label=label)
        axes[2].plot(xs, [sum(r.decision_us().values()) for _, r in pts], marker="o", label=label)
    for ax, title in zip(
        axes, ("mean TTFT (simulated ms)", "prefix hit rate (%)", "decision time (us per request)"), strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("instances")
        ax.set_title(title)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default="conversation")
    p.add_argument("--requests", type=int, default=300, help="trace rows (per copy)")
    p.add_argument("--rate", type=float, default=1.25, help="arrival compression per copy (simulated time)")
    p.add_argument("--instances", type=int, default=4, help="fleet size (rows, sweep)")
    p.add_argument("--npu-blocks", type=int, default=16384)
    p.add_argument("--max-input", type=int, default=8192)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--load-interval", type=float, default=5.0, help="engine load report period, simulated s")
    p.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="processes (0: one per core)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("rows", "sweep", "scale"):
        s = sub.add_parser(name)
        add_arguments(s)
        s.add_argument("--output-dir", help="write fleet-<cmd>.md (and a plot for scale) here")
        if name == "sweep":
            s.add_argument("--no-write", dest="write", action="store_false", help="do not update the tuned file")
        if name == "scale":
            s.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512])
            s.add_argument("--base-instances", type=int, default=4, help="instances per copy of the trace")
    args = parser.parse_args(argv)

    from tqdm import tqdm

    total = {"rows": len(POLICY_ROWS) + 1, "sweep": None, "scale": None}[args.cmd]
    with tqdm(total=total, desc=f"fleet {args.cmd}", unit="run", file=sys.stderr) as bar:
        if args.cmd == "rows":
            text, _ = cmd_rows(args, bar.update)
        elif args.cmd == "sweep":
            text, _ = cmd_sweep(args, bar.update)
        else:
            text, rows = cmd_scale(args, bar.update)
    print(text)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"fleet-{args.cmd}.md").write_text(text + "\n")
        if args.cmd == "scale":
            plot_scale(rows, out / "fleet-scale.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
