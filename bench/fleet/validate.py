"""Validation of the fleet simulator against a real-time replay through the mesh, on the same configuration."""

from __future__ import annotations

import statistics

from bench.fleet.sim import FleetResult


def _diff(sim: float, real: float) -> str:
    return f"{(sim - real) / real:+.0%}" if real else "n/a"


def compare(
    real_rows,
    fleet: dict[str, FleetResult],
    speedup: float,
    jittered: dict[str, list[FleetResult]] | None = None,
) -> tuple[str, float]:
    """A markdown table of real (`bench.policies.Row`, wall-clock TTFT x speedup) against simulated figures per
    policy, and the largest relative difference over TTFT p50/p90/p99/mean and hit rate."""
    lines = [
        "| policy | source | TTFT p50 | p90 | p99 | mean | prefix hit rate | Match fallbacks |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    worst = 0.0
    for row in real_rows:
        sim = fleet.get(row.label)
        r = row.result
        if sim is None or not r.ttft_s:
            continue
        k = speedup
        real = [r.pct(r.ttft_s, q) * k for q in (50, 90, 99)] + [statistics.fmean(r.ttft_s) * k, row.hit_rate]
        simv = [sim.pct(50), sim.pct(90), sim.pct(99), sim.mean_ttft, sim.hit_rate]
        for a, b in zip(simv, real, strict=True):
            if b:
                worst = max(worst, abs(a - b) / b)
        lines.append(
            f"| {row.label} | real-time mesh | "
            + " | ".join(f"{v * 1000:.0f}" for v in real[:4])
            + f" | {real[4]:.1%} | {row.fallbacks:.0f} |"
        )
        lines.append(
            f"| {row.label} | fleet simulator | "
            + " | ".join(f"{v * 1000:.0f}" for v in simv[:4])
            + f" | {simv[4]:.1%} | |"
        )
        runs = (jittered or {}).get(row.label)
        if runs:
            cells = []
            for f in (lambda x: x.pct(50), lambda x: x.pct(90), lambda x: x.pct(99), lambda x: x.mean_ttft):
                values = [f(x) * 1000 for x in runs]
                cells.append(f"{min(values):.0f}-{max(values):.0f}")
            hits = [x.hit_rate for x in runs]
            lines.append(
                f"| {row.label} | simulator, {len(runs)} jittered runs (range) | "
                + " | ".join(cells)
                + f" | {min(hits):.1%}-{max(hits):.1%} | |"
            )
        lines.append(
            f"| {row.label} | difference | "
            + " | ".join(_diff(a, b) for a, b in zip(simv, real, strict=True))
            + " | |"
        )
    return "\n".join(lines), worst
