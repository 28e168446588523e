"""Named experiments on the fleet simulator: policy rows, the kv_affinity sweep, the scale table."""

from __future__ import annotations

import gc
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from bench.fleet.instance import EngineSpec
from bench.fleet.sim import FleetConfig, FleetResult, simulate
from bench.fleet.workload import arrivals
from bench.trace import load_rows

J = TypeVar("J")
R = TypeVar("R")

#: Tandem's policies and the peers' re-implementations, by label: (type, params).
POLICY_ROWS: dict[str, tuple[str, Mapping[str, Any] | None]] = {
    "round_robin": ("round_robin", None),
    "least_load": ("least_load", None),
    "sglang_cache_aware": ("sglang_cache_aware", None),
    "llm_d": ("llm_d", None),
    "dynamo": ("dynamo", None),
    "kv_affinity": ("kv_affinity", None),
}

#: The sweep's grid over kv_affinity's parameters: (load_weight values, pressure_scale values) in mode blend.
SWEEP_GRID: tuple[list[float], list[float]] = ([0.25, 0.35, 0.5, 1.0], [0.0, 1.0, 2.0, 4.0])


@dataclass(frozen=True)
class Workload:
    """The trace slice and load a run replays."""

    trace: str = "conversation"
    requests: int = 300  # rows of the trace (per copy)
    rate: float = 1.25  # arrival compression (simulated time)
    max_input: int = 8192
    max_output: int = 64
    seed: int = 0  # a generated workload's seed (`bench.workloads`); the copies' time shifts
    copies: int = 1  # independent copies of the trace (disjoint prefixes), for larger fleets

    def arrivals(self):
        rows = load_rows(self.trace, self.requests, self.max_input, self.max_output, seed=self.seed)
        return arrivals(rows, self.rate, self.copies, self.seed)


def _token_ids() -> list[int]:
    from tandem.tokenizer import load_tokenizer

    return load_tokenizer(None).word_ids


def run_one(job: tuple[FleetConfig, Workload]) -> FleetResult:
    """One simulation (picklable, for process pools)."""
    cfg, work = job
    return simulate(cfg, work.arrivals(), _token_ids(), work.seed)


def collector_paused(run: Callable[[J], R], job: J) -> R:
    """`run(job)` with CPython's cyclic garbage collector off. A simulation holds millions of long-lived objects
    (every engine's blocks, the conductor's index) that each of the collector's passes walks again, and makes
    almost no reference cycles: the passes took a quarter of a 4-instance routing cell's time and 13-45% of a
    512-instance run's (the more requests, the more), for the same results and the same peak memory (reference
    counting frees the rest)."""
    if not gc.isenabled():
        return run(job)
    gc.disable()
    try:
        return run(job)
    finally:
        gc.enable()


def run_many(jobs: Sequence[J], workers: int = 0, progress=None, run: Callable[[J], R] = run_one) -> list[R]:
    """`run(job)` for every job (by default a simulation), in `workers` processes (0: one per core; `run` and the
    jobs must pickle), results in job order; `progress(1)` after each."""
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(jobs) <= 1:
        out = []
        for job in jobs:
            out.append(collector_paused(run, job))
            if progress is not None:
                progress(1)
        return out
    results: list[Any] = [None] * len(jobs)
    with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
        futures = {pool.submit(collector_paused, run, job): i for i, job in enumerate(jobs)}
        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            if progress is not None:
                progress(1)
    return results


def sweep_jobs(base: FleetConfig, work: Workload) -> list[tuple[dict, tuple[FleetConfig, Workload]]]:
    out = []
    for weight, scale in itertools.product(*SWEEP_GRID):
        params = {"load_weight": weight, "pressure_scale": scale}
        out.append((params, (replace(base, policy="kv_affinity", params=params), work)))
    return out


def score(r: FleetResult) -> float:
    """What the sweep minimises: mean plus p99 TTFT (simulated seconds)."""
    return r.mean_ttft + r.pct(99)


def scale_jobs(
    sizes: list[int], base_instances: int, engine: EngineSpec, work: Workload, **kw
) -> list[tuple[int, str, tuple[FleetConfig, Workload]]]:
    """For each fleet size, one job per policy row; the trace is tiled so the load per instance stays that of
    `base_instances` instances under `work`."""
    out = []
    for n in sizes:
        copies = max(1, round(n / base_instances))
        w = replace(work, copies=copies)
        for label, (policy, params) in POLICY_ROWS.items():
            cfg = FleetConfig(instances=n, policy=policy, params=params, engine=engine, **kw)
            out.append((n, label, (cfg, w)))
    return out
