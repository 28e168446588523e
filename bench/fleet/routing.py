"""Routing quality per workload in the fleet simulator: every policy on the same arrivals, at load levels set
against round robin's prefill capacity, over fleet sizes and seeds (`python -m bench.fleet routing`).

Load level: a workload's arrivals are compressed until the prefill tokens round robin leaves to compute (its
prompts minus what each instance already holds, with unbounded per-instance caches, in arrival order) arrive at
`load` times the fleet's prefill capacity (instances times one engine's prefill rate, tokens/s at a full
8192-token chunk of the timing profile). Each run measures `warm` requests after `warmup` ones that fill the
caches. A fleet of 16 serves one population (the same generator or trace window, more requests at a higher
rate), never copies of a smaller one.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bench.fleet.instance import EngineSpec
from bench.fleet.runs import POLICY_ROWS, run_many
from bench.fleet.sim import FleetConfig, FleetResult
from bench.fleet.workload import Arrival, PromptSource, arrivals
from bench.trace import load_rows
from simengine.profiles import PROFILES

#: The rows of the table: every policy row of the simulator (peers with their own defaults).
ROUTING_ROWS = POLICY_ROWS
TANDEM = "kv_affinity"
PEERS = ("round_robin", "least_load", "sglang_cache_aware", "llm_d", "dynamo")
REUSE_HEAVY = ("tenants_rag", "sessions_agents")


def prefill_rate(engine: EngineSpec) -> float:
    """One engine's prefill tokens per second at a full chunk of its step budget."""
    n = engine.max_num_batched_tokens
    return n / PROFILES[engine.profile].step_s([(n, 0)], 0, 0)


def round_robin_prefill(hashed: Sequence[tuple[int, list[int]]], instances: int, block: int) -> int:
    """Prompt tokens round robin leaves to compute, with an unbounded cache per instance; `hashed` holds each
    prompt's (length, chain hashes) in arrival order."""
    caches: list[set[int]] = [set() for _ in range(instances)]
    total = 0
    for i, (length, hashes) in enumerate(hashed):
        cache = caches[i % instances]
        n = 0
        for h in hashes:
            if h not in cache:
                break
            n += 1
        total += length - min(n * block, (length - 1) // block * block)
        cache.update(hashes)
    return total


@dataclass(frozen=True)
class Cell:
    """One (workload, fleet size, load, seed) configuration, at one cache size."""

    workload: str
    instances: int
    load: float
    seed: int
    npu_blocks: int = 0  # NPU blocks per engine (0: the engine spec's); arrivals do not depend on it

    def engine(self, base: EngineSpec) -> EngineSpec:
        return replace(base, npu_blocks=self.npu_blocks) if self.npu_blocks else base


@dataclass
class CellResult:
    cell: Cell
    rate_scale: float
    ideal_hit_rate: float
    results: dict[str, FleetResult] = field(default_factory=dict)


def cell_arrivals(
    cell: Cell,
    warm: int,
    warmup: int,
    engine: EngineSpec,
    word_ids: list[int],
    max_input: int,
    max_output: int,
) -> tuple[list[Arrival], float, float]:
    """The cell's arrivals at its load level, the rate scale used, and the workload's ideal hit rate."""
    from bench.workloads import GENERATORS, ideal_hit_rate
    from tandem.chain_hash import chain_hashes

    n = warm + warmup
    skip = 0 if cell.workload in GENERATORS else cell.seed * n  # a trace: seeds take successive windows
    rows = load_rows(cell.workload, n, max_input, max_output, seed=cell.seed, skip=skip)
    base = arrivals(rows, 1.0)
    prompts = PromptSource(word_ids, cell.seed)
    hashed = []
    for a in base:
        tokens = prompts.tokens(a)
        hashed.append((len(tokens), chain_hashes(tokens, engine.block_size)))
    demand = round_robin_prefill(hashed, cell.instances, engine.block_size)
    span = base[-1].at_s - base[0].at_s
    capacity = cell.load * cell.instances * prefill_rate(engine)
    scale = capacity * span / demand if demand else 1.0
    ideal = ideal_hit_rate(hashed, engine.block_size, warmup)
    return arrivals(rows, scale), scale, ideal


def _prepare(job) -> tuple[list[Arrival], float, float]:
    cell, warm, warmup, engine, max_input, max_output = job
    from bench.fleet.runs import _token_ids

    return cell_arrivals(cell, warm, warmup, engine, _token_ids(), max_input, max_output)


def verdict(cell_rows: Mapping[str, tuple[float, float]], reuse_heavy: bool) -> str:
    """`cell_rows`: label -> (mean TTFT, p99 TTFT), averaged over seeds."""
    t_mean, t_p99 = cell_rows[TANDEM]
    peers = {k: v for k, v in cell_rows.items() if k != TANDEM}
    if reuse_heavy:
        worst = max(peers, key=lambda k: max(t_mean / peers[k][0], t_p99 / peers[k][1]))
        ratio = max(t_mean / peers[worst][0], t_p99 / peers[worst][1])
        ok = ratio <= 0.9
        return f"{'met' if ok else 'missed'} (closest: {worst}, x{ratio:.2f} on {'mean' if t_mean / peers[worst][0] >= t_p99 / peers[worst][1] else 'p99'})"
    best_mean = min(v[0] for v in peers.values())
    best_p99 = min(v[1] for v in peers.values())
    ok = t_mean <= best_mean and t_p99 <= best_p99
    return f"{'met' if ok else 'missed'} (mean x{t_mean / best_mean:.2f}, p99 x{t_p99 / best_p99:.2f} of the best peer)"


def run_cells(
    cells: Sequence[Cell],
    rows: Mapping[str, tuple[str, Mapping[str, Any] | None]],
    warm: int,
    warmup: int,
    engine: EngineSpec,
    word_ids: list[int],
    max_input: int = 8192,
    max_output: int = 64,
    workers: int = 0,
    progress=None,
    base: FleetConfig | None = None,
) -> list[CellResult]:
    """Every row on every cell."""
    out: list[CellResult] = []
    jobs = []
    loads = list(dict.fromkeys(replace(c, npu_blocks=0) for c in cells))  # arrivals: one per cache size
    prepared = dict(
        zip(loads, _prepare_all(loads, warm, warmup, engine, max_input, max_output, workers), strict=True)
    )
    for cell in cells:
        arr, scale, ideal = prepared[replace(cell, npu_blocks=0)]
        out.append(CellResult(cell, scale, ideal))
        for label, (policy, params) in rows.items():
            cfg = replace(
                base or FleetConfig(),
                instances=cell.instances,
                policy=policy,
                params=params,
                engine=cell.engine(engine),
                warmup=warmup,
                seed=cell.seed,
                sample_replication=True,
            )
            jobs.append((len(out) - 1, label, (cfg, ArrivalsWork(arr, cell.seed))))
    results = run_many([j for _, _, j in jobs], workers, progress)
    for (i, label, _), r in zip(jobs, results, strict=True):
        out[i].results[label] = r
    return out


def _prepare_all(cells, warm, warmup, engine, max_input, max_output, workers):
    jobs = [(c, warm, warmup, engine, max_input, max_output) for c in cells]
    return run_many(jobs, workers, run=_prepare)


@dataclass(frozen=True)
class ArrivalsWork:
    """Explicit arrivals in the shape of `bench.fleet.runs.Workload` (what `run_many` replays)."""

    arr: list[Arrival]
    seed: int

    def arrivals(self) -> list[Arrival]:
        return self.arr


def _groups(cells: Sequence[CellResult]) -> dict[tuple[str, int, int, float], list[CellResult]]:
    """Results by (workload, instances, NPU blocks, load), seeds together."""
    groups: dict[tuple[str, int, int, float], list[CellResult]] = {}
    for c in cells:
        groups.setdefault((c.cell.workload, c.cell.instances, c.cell.npu_blocks, c.cell.load), []).append(c)
    return groups


def table(cells: Sequence[CellResult], slo_s: float = 3.0) -> str:
    """Markdown: one block per (workload, instances, cache size, load), rows averaged over seeds with their
    spread."""
    lines = [
        "| workload | instances | NPU blocks | load | policy | TTFT mean | p50 | p99 | hit rate | ideal hit rate "
        "| evictions / request | blocks held twice or more | output tok/s | goal |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (workload, n, blocks, load), group in _groups(cells).items():
        labels = list(group[0].results)
        name = _short(workload)
        goal = verdict(_means(group), workload in REUSE_HEAVY)
        ideal = statistics.fmean(g.ideal_hit_rate for g in group)
        for label in labels:
            rs = [g.results[label] for g in group]
            lines.append(
                f"| {name} | {n} | {blocks} | {load:.0%} | {label} | {_spread([r.mean_ttft for r in rs])} "
                f"| {_spread([r.pct(50) for r in rs])} | {_spread([r.pct(99) for r in rs])} "
                f"| {statistics.fmean(r.hit_rate for r in rs):.1%} | {ideal:.1%} "
                f"| {statistics.fmean(r.evictions_per_request for r in rs):.0f} "
                f"| {statistics.fmean(r.replicated for r in rs):.1%} "
                f"| {statistics.fmean(r.output_tps for r in rs):.0f} | {goal if label == TANDEM else ''} |"
            )
    return "\n".join(lines)


def _means(group: Sequence[CellResult]) -> dict[str, tuple[float, float]]:
    """Per row, (mean TTFT, p99 TTFT) averaged over the group's seeds."""
    return {
        label: (
            statistics.fmean(g.results[label].mean_ttft for g in group),
            statistics.fmean(g.results[label].pct(99) for g in group),
        )
        for label in group[0].results
    }


def goals_met(cells: Sequence[CellResult]) -> tuple[int, int]:
    """(table blocks whose goal is met, table blocks)."""
    verdicts = [
        verdict(_means(group), workload in REUSE_HEAVY).startswith("met")
        for (workload, _, _, _), group in _groups(cells).items()
    ]
    return sum(verdicts), len(verdicts)


def plot_cache_sizes(cells: Sequence[CellResult], path) -> None:
    """Mean TTFT against NPU blocks per engine, one line per policy; one panel per (workload, load), at the
    smallest fleet size (seeds averaged)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(cells)
    n = min(c.cell.instances for c in cells)
    workloads = list(dict.fromkeys(c.cell.workload for c in cells))
    loads = sorted({c.cell.load for c in cells})
    fig, axes = plt.subplots(
        len(workloads), len(loads), figsize=(4.2 * len(loads), 3.2 * len(workloads)), squeeze=False
    )
    for i, workload in enumerate(workloads):
        for j, load in enumerate(loads):
            ax = axes[i][j]
            keys = sorted(k for k in groups if k[0] == workload and k[1] == n and k[3] == load)
            labels = list(groups[keys[0]][0].results) if keys else []
            for label in labels:
                xs = [k[2] for k in keys]
                ys = [statistics.fmean(g.results[label].mean_ttft for g in groups[k]) * 1000 for k in keys]
                ax.plot(xs, ys, marker="o", label=label, linewidth=2.5 if label == TANDEM else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{_short(workload)}, {n} instances, load {load:.0%}", fontsize=9)
            ax.set_xlabel("NPU blocks per engine")
            ax.set_ylabel("mean TTFT (simulated ms)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _short(workload: str) -> str:
    if workload.endswith("_trace.jsonl"):
        return "mooncake " + workload.rsplit("/", 1)[-1].removesuffix("_trace.jsonl")
    if workload in ("conversation", "synthetic"):
        return f"mooncake {workload}"
    return workload


def _spread(values: list[float]) -> str:
    """Mean over seeds in simulated ms, with the half range (±)."""
    mean = statistics.fmean(values) * 1000
    if len(values) < 2:
        return f"{mean:.0f}"
    half = (max(values) - min(values)) * 500
    return f"{mean:.0f} ±{half:.0f}"


def signal_table(results: Mapping[str, FleetResult]) -> str:
    """Ledger prefill against the true queued prefill, per signal."""
    lines = [
        "| signal | ledger prefill / true queued prefill | mean abs. error / mean true | TTFT mean | p99 |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, r in results.items():
        lines.append(
            f"| {label} | {r.signal_ratio:.2f} | {r.signal_error:.1%} | {r.mean_ttft * 1000:.0f} "
            f"| {r.pct(99) * 1000:.0f} |"
        )
    return "\n".join(lines)
