"""`python -m bench.fleet pd`: every P/D rule on the same arrivals, each at its own best P:D split, against
aggregated serving; on generated workloads at load levels (grid) or on one Mooncake-format trace.

A rule's best split is the prefill count with the most requests within the SLOs, then the lowest mean TTFT, found
in two rounds (`bench.fleet.pd.splits`: a quarter, half and three quarters of the fleet; then `refine`: the best
one's untried neighbours), or `--prefill` alone. The `aggregated` row runs every instance hybrid.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bench.fleet.pd import PdConfig, PdResult, best, refine, simulate_pd, splits
from bench.fleet.pd_rules import RULES
from bench.fleet.runs import _token_ids, run_many

#: Rows of the table, in order.
PD_ROWS = tuple(RULES)


def run_pd_one(job: tuple[PdConfig, Any]) -> PdResult:
    """One simulation (picklable, for process pools); `work` has `arrivals()` and `seed`."""
    cfg, work = job
    return simulate_pd(cfg, work.arrivals(), _token_ids(), work.seed)


def rule_jobs(
    base: PdConfig,
    work: Any,
    rules: Sequence[str],
    prefill: int | None,
    round_two: dict[str, list[int]] | None = None,
) -> list[tuple[str, tuple]]:
    """(rule, job) for every rule at every split of the sweep's first round (one job for `aggregated`), or of
    `round_two` (rule -> splits) when given."""
    out = []
    for rule in rules:
        if round_two is not None:
            out += [(rule, (replace(base, rule=rule, prefill=p), work)) for p in round_two.get(rule, [])]
            continue
        if not RULES[rule]().disaggregates:
            out.append((rule, (replace(base, rule=rule, prefill=0), work)))
            continue
        for p in [prefill] if prefill else splits(base.instances):
            out.append((rule, (replace(base, rule=rule, prefill=p), work)))
    return out


def sweep(
    base: PdConfig, work: Any, rules: Sequence[str], prefill: int | None, workers: int = 0, progress=None
) -> dict[str, PdResult]:
    """Each rule's best run over the two rounds of splits (or at `prefill`)."""
    jobs = rule_jobs(base, work, rules, prefill)
    labels = [label for label, _ in jobs]
    results = run_many([j for _, j in jobs], workers, progress, run=run_pd_one)
    if not prefill:
        first = best_per_rule(labels, results)
        tried: dict[str, list[int]] = {}
        for label, (cfg, _) in jobs:
            tried.setdefault(label, []).append(cfg.prefill)
        more = {
            label: refine(base.instances, tried[label], r.prefill) for label, r in first.items() if r.prefill
        }
        jobs2 = rule_jobs(base, work, rules, prefill, more)
        if jobs2:
            labels += [label for label, _ in jobs2]
            results += run_many([j for _, j in jobs2], workers, progress, run=run_pd_one)
    SWEEP_COST[0] += len(results)
    SWEEP_COST[1] += sum(r.cpu_s for r in results)
    return best_per_rule(labels, results)


#: Simulations run and their CPU seconds, summed over every `sweep` of this process (for the report's footer).
SWEEP_COST = [0, 0.0]


def best_per_rule(labels: Sequence[str], results: Sequence[PdResult]) -> dict[str, PdResult]:
    by: dict[str, list[PdResult]] = {}
    for label, r in zip(labels, results, strict=True):
        by.setdefault(label, []).append(r)
    return {label: best(rs) for label, rs in by.items()}


@dataclass
class PdCell:
    """One (workload, instances, nodes, load, seed) configuration and each rule's best run."""

    workload: str
    instances: int
    nodes: int
    load: float
    seed: int
    best: dict[str, PdResult] = field(default_factory=dict)


HEADER = (
    "| rule | P:D | suggested | mean | p99 | itl p99 | goodput | bytes across nodes | hit rate | local share | "
    "most waiting on one instance |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def row(label: str, rs: Sequence[PdResult], instances: int) -> str:
    """One table row, averaged over `rs` (seeds): TTFT and ITL in simulated ms, goodput in requests per simulated
    second, bytes across nodes in GB, hit rate and local share as fractions; suggested: the coordinator's P:D
    sizing from the run's demand (`bench.fleet.pd.suggest`)."""

    def avg(f) -> float:
        return statistics.fmean(f(r) for r in rs)

    split = ", ".join(sorted({f"{r.prefill}:{instances - r.prefill}" if r.prefill else "-" for r in rs}))
    suggested = ", ".join(sorted({suggested_split(r) for r in rs}))
    local = avg(lambda r: r.local / max(r.local + r.disaggregated, 1)) if rs[0].prefill else 1.0
    return (
        f"| {label} | {split} | {suggested} | {avg(lambda r: r.mean_ttft) * 1000:.0f} | {avg(lambda r: r.pct(99)) * 1000:.0f} "
        f"| {avg(lambda r: r.itl_p99) * 1000:.1f} | {avg(lambda r: r.goodput):.2f} "
        f"| {avg(lambda r: r.bytes_inter_node) / 1e9:.1f} | {avg(lambda r: r.hit_rate):.3f} | {local:.2f} "
        f"| {avg(lambda r: max(r.max_waiting.values(), default=0)):.0f} |"
    )


def suggested_split(r: PdResult) -> str:
    """The coordinator's suggested P:D (`coordinator.capacity`) from the run's demand, as `P:D`."""
    z = r.sizing
    return f"{z.suggested_prefill}:{z.suggested_decode}" if z is not None else "-"


def cost_line(runs: int, cpu_s: float) -> str:
    """What the sweep cost: runs and CPU seconds (the wall time on idle cores is about CPU / cores)."""
    return (
        f"{runs} simulations, {cpu_s:.0f} CPU seconds in all ({cpu_s / max(runs, 1):.2g} s per simulation)."
    )


def table(best_runs: dict[str, list[PdResult]], instances: int) -> str:
    return "\n".join([HEADER, *(row(label, rs, instances) for label, rs in best_runs.items())])
