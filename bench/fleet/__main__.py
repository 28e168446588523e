"""Fleet simulator: Tandem's policies, the conductor's index and simengine's cache and timing model in virtual
time, in-process, so a whole trace replays against 8 to 512 instances in minutes.

    python -m bench.fleet rows   [--instances 4] [--rate 1.25] [--requests 300] ...   # one row per policy
    python -m bench.fleet sweep  [...]   # kv_affinity parameter grid against the peers (exploration)
    python -m bench.fleet scale  [--sizes 8 64 512] [--base-instances 8] ...
    python -m bench.fleet validate [--instances 2] [--rate 0.625] [--speedup 2] ...  # against the real mesh
    python -m bench.fleet signal  # the ledger's prefill against the true queued prefill; 30-minute drift
    python -m bench.fleet pd      [--workloads ...] [--sizes 8] [--nodes 2] [--loads 0.6 0.9] [--seeds 0]
                                  [--prefill N] [--mode handoff|trigger]   # P/D rules, each at its best P:D split
    python -m bench.fleet pd --trace FILE --requests N --rate R --instances N --npu-blocks B --nodes N
    python -m bench.fleet overload [--instances 4] [--bursts 1.5 3] [--steady 0.8] [--mixed] [--no-peers]  # admission
    python -m bench.fleet lora    [--adapters 50 500] [--sizes 8 32] [--max-loras 4] [--load-s 0.25]   # LoRA routing
    python -m bench.fleet routing [--full] [--workloads ...] [--sizes 4] [--cache-sizes 2048 4096 8192 16384]
                                  [--loads 0.6 0.9 1.2] [--seeds 0] [--kv-params JSON]

Every figure is simulated time; the same seed gives the same figures. Decision times are wall-clock time of the
coordinator's and conductor's own Python (Match, candidate building, pick), per decision.
"""

from __future__ import annotations

import argparse
import json
import os
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
from bench.fleet.sim import REPLICATION_EVERY, FleetConfig, FleetResult

#: The routing table's workloads with `--full`: the reuse-heavy generators and both Mooncake traces.
FULL_WORKLOADS = ("tenants_rag", "sessions_agents", "conversation", "synthetic")


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
        f"engine (ascend-910b), {_signal_caption(args)}, seed {args.seed}. TTFT in simulated ms."
    )


def _signal_caption(args) -> str:
    every = (
        f"every {args.load_interval:g} s"
        if args.load_interval is not None
        else "every 0.25 s (llm_d: 50 ms, its endpoint picker's default)"
    )
    if args.signal:
        return f"engine load reported {every}, prefill leaves the ledger by signal `{args.signal}` for every policy"
    return (
        f"engine load and progress counters reported {every}; prefill leaves the ledger when the engines' "
        "prompt-token counter shows it done (dynamo: at the first token, as its router does)"
    )


def base_config(args, policy: str, params) -> FleetConfig:
    return FleetConfig(
        args.instances, policy, params, engine(args), load_interval_s=args.load_interval, signal=args.signal
    )


def workload(args) -> Workload:
    return Workload(args.trace, args.requests, args.rate, args.max_input, args.max_output, args.seed)


def engine(args) -> EngineSpec:
    return EngineSpec(npu_blocks=args.npu_blocks)


def cmd_rows(args, progress=None) -> tuple[str, dict[str, FleetResult]]:
    jobs = [(base_config(args, p, params), workload(args)) for p, params in POLICY_ROWS.values()]
    results = dict(zip(POLICY_ROWS, run_many(jobs, args.workers, progress), strict=True))
    lines = [
        caption(args, f"Fleet simulator, {args.instances} instances"),
        "",
        "| policy | TTFT p50 | p90 | p99 | mean | within SLO | output tok/s | prefix hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(f"| {k} | {row_cells(r, args.ttft_slo_ms / 1000)} |" for k, r in results.items()),
    ]
    return "\n".join(lines), results


def cmd_sweep(args, progress=None) -> tuple[str, dict]:
    base = base_config(args, "kv_affinity", None)
    grid = sweep_jobs(base, workload(args))
    peers = [
        (label, (replace(base, policy=p, params=params), workload(args)))
        for label, (p, params) in POLICY_ROWS.items()
    ]
    results = run_many([j for _, j in grid] + [j for _, j in peers], args.workers, progress)
    swept = list(zip([p for p, _ in grid], results[: len(grid)], strict=True))
    peer_results = dict(zip([label for label, _ in peers], results[len(grid) :], strict=True))
    best_params, best = min(swept, key=lambda pr: score(pr[1]))
    others = {k: v for k, v in peer_results.items() if k != "kv_affinity"}
    beats = all(best.mean_ttft < r.mean_ttft and best.pct(99) < r.pct(99) for r in others.values())
    chosen = {"params": best_params, "score_s": round(score(best), 4), "beats_peers_in_sim": beats}
    weights, scales = SWEEP_GRID
    lines = [
        caption(args, f"kv_affinity sweep, {args.instances} instances")
        + f" Grid: `load_weight` in {weights}, `pressure_scale` in {scales}. Ranked by mean + p99 TTFT; the five "
        "best and the peers:",
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
        f"Best here: `{json.dumps(best_params)}`; it "
        + ("beats" if beats else "does not beat")
        + " every other policy on both mean and p99 TTFT.",
    ]
    return "\n".join(lines), chosen


def cmd_scale(args, progress=None) -> tuple[str, list]:
    jobs = scale_jobs(
        args.sizes,
        args.base_instances,
        engine(args),
        workload(args),
        load_interval_s=args.load_interval,
    )
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


def cmd_validate(args, progress=None) -> tuple[str, float]:
    """The same trace slice, engines and policies replayed through the real mesh (in real time, at `--speedup`)
    and through the simulator; engine load reaches the coordinator every 0.5 s of wall time there."""
    import tempfile
    from argparse import Namespace

    from bench.fleet.validate import compare
    from bench.policies import run_row_isolated
    from bench.trace import load_trace
    from tandem.tokenizer import load_tokenizer

    real_args = Namespace(
        speedup=args.speedup,
        npu_blocks=args.npu_blocks,
        engines=args.instances,
        match_timeout_ms=args.match_timeout_ms,
    )
    tok = load_tokenizer(None)
    requests = load_trace(
        args.trace, args.requests, args.rate * args.speedup, tok, args.seed, args.max_input, args.max_output
    )
    workdir = Path(tempfile.mkdtemp(prefix="tandem-validate-"))
    real = []
    load_before = os.getloadavg()[0]
    for label in args.rows:
        real.append(run_row_isolated(label, real_args, requests, workdir))
        if progress is not None:
            progress(1)
    load_after = os.getloadavg()[0]
    load_interval = 0.25 * args.speedup  # the node agents' load_interval_s, in simulated seconds
    fleet = {}
    for label in args.rows:
        policy, params = POLICY_ROWS[label]
        cfg = FleetConfig(args.instances, policy, params, engine(args), load_interval_s=load_interval)
        fleet[label] = run_many([(cfg, workload(args))], 1)[0]
        if progress is not None:
            progress(1)
    # Sensitivity: the same runs with a few ms of seeded routing jitter (the real mesh's routing time varies).
    jitter_s = args.jitter_ms / 1000 * args.speedup
    jobs = [
        (
            label,
            replace(
                FleetConfig(args.instances, *POLICY_ROWS[label], engine(args), load_interval_s=load_interval),
                route_jitter_s=jitter_s,
                seed=s,
            ),
        )
        for label in args.rows
        for s in range(1, args.jitter_runs + 1)
    ]
    results = run_many([(cfg, workload(args)) for _, cfg in jobs], args.workers)
    jittered: dict[str, list[FleetResult]] = {}
    for (label, _), r in zip(jobs, results, strict=True):
        jittered.setdefault(label, []).append(r)
    if progress is not None:
        progress(1)
    table, worst = compare(real, fleet, args.speedup, jittered)
    args.load_interval = load_interval
    head = (
        caption(args, f"Fleet simulator against the real-time mesh, {args.instances} engines")
        + f" Real-time side: `bench.policies` replay at speedup {args.speedup:g} (TTFT x speedup), conductor "
        f"Match deadline {args.match_timeout_ms:g} ms; simulator: engine load every {load_interval:g} simulated s; "
        f"jittered runs add a seeded uniform 0-{args.jitter_ms:g} ms (wall) routing delay per request. "
        f"Machine load average (1 min) before / after the real-time side: {load_before:.1f} / {load_after:.1f} "
        "(2 cores; other work shares the machine)."
    )
    verdict = (
        f"Largest difference (simulator without jitter against the mesh) over TTFT p50/p90/p99/mean and hit rate: {worst:.1%}"
        + (" (within 10%)." if worst <= 0.10 else " (more than 10%).")
    )
    return f"{head}\n\n{table}\n\n{verdict}", worst


def cmd_signal(args, progress=None) -> tuple[str, dict]:
    """How well each way of learning prefill progress follows the true queued prefill, and the drift of Tandem's
    signal over a 30-minute replay with aborts, an engine restart and a coordinator restart."""
    from bench.fleet.routing import ArrivalsWork, Cell, cell_arrivals, prefill_rate, signal_table
    from bench.fleet.sim import Faults

    eng = engine(args)
    ids = _token_ids()
    rate = prefill_rate(eng)
    cases = [
        ("end (before issue 11: at response end)", {"signal": "end"}),
        ("first token, exact (a router in the token path)", {"signal": "first_token"}),
        ("engine counters every 0.25 s (Tandem)", {"signal": "counter", "load_interval_s": 0.25}),
        ("engine counters every 1 s", {"signal": "counter", "load_interval_s": 1.0}),
        (
            f"engine counters every 0.25 s + time model ({rate:.0f} tok/s)",
            {"signal": "counter", "load_interval_s": 0.25, "prefill_rate_tokens_per_s": rate},
        ),
    ]
    sections = []
    summary: dict = {}
    for workload, n, load in ((args.trace, 4, 0.9), ("tenants_rag", 4, 0.9)):
        arr, _, _ = cell_arrivals(
            Cell(workload, n, load, 0), 1000, 200, eng, ids, args.max_input, args.max_output
        )
        jobs = [
            (FleetConfig(n, "kv_affinity", None, eng, warmup=200, **kw), ArrivalsWork(arr, 0))
            for _, kw in cases
        ]
        results = dict(
            zip([label for label, _ in cases], run_many(jobs, args.workers, progress), strict=True)
        )
        summary[workload] = results
        sections.append(
            f"{_short(workload)}, {n} instances at {load:.0%} of round robin's prefill capacity, kv_affinity, "
            "1,000 measured requests after 200:\n\n" + signal_table(results)
        )
    # Drift: 30 simulated minutes, 2 instances at 60%, with faults.
    minutes = 30
    cell = Cell("tenants_rag", 2, 0.6, 0)
    probe, scale, _ = cell_arrivals(cell, 1000, 0, eng, ids, args.max_input, args.max_output)
    per_s = len(probe) / (probe[-1].at_s - probe[0].at_s)
    need = int(per_s * minutes * 60)
    arr, _, _ = cell_arrivals(cell, need, 0, eng, ids, args.max_input, args.max_output)
    span = arr[-1].at_s - arr[0].at_s
    if span < minutes * 60:  # a larger population reuses more, so its load level compresses time more: top up
        need = int(need * minutes * 60 / span) + 1
        arr, _, _ = cell_arrivals(cell, need, 0, eng, ids, args.max_input, args.max_output)
    span_min = (arr[-1].at_s - arr[0].at_s) / 60
    faults = Faults(
        abort_share=0.05, abort_within_s=2.0, engine_restarts=((600.0, 1),), coordinator_restarts=(1200.0,)
    )
    cfg = FleetConfig(2, "kv_affinity", None, eng, faults=faults)
    (drift,) = run_many([(cfg, ArrivalsWork(arr, 0))], 1, progress)
    lines = [
        "| minutes | mean abs. error of the ledger's prefill (tokens) | mean true queued prefill (tokens) |",
        "|---|---:|---:|",
    ]
    for start, err, true in drift.error_windows:
        m0 = (start - arr[0].at_s) / 60
        lines.append(f"| {m0:.0f}-{m0 + 5:.0f} | {err:.0f} | {true:.0f} |")
    sections.append(
        f"Drift: tenants_rag, 2 instances at 60%, {len(arr)} requests over {span_min:.0f} simulated minutes; 5% of "
        "requests cut by their client within 2 s, engine sim-1 killed and restarted (counters back to zero) at "
        "minute 10, the coordinator restarted (empty ledger, requests in flight unknown to it) at minute 20:\n\n"
        + "\n".join(lines)
        + f"\n\nLeft on the ledger after the last request ended: {drift.residual_tokens} tokens, "
        f"{drift.residual_requests} requests; over the whole replay the ledger's prefill averaged "
        f"{drift.signal_ratio:.2f}x the true queued prefill (mean absolute error {drift.signal_error:.0%})."
    )
    summary["drift"] = drift
    return "\n\n".join(sections), summary


def cmd_routing(args, progress=None) -> tuple[str, list]:
    """The routing-quality table: every policy per workload, fleet size, load level and seed."""
    from bench.fleet.routing import ROUTING_ROWS, Cell, goals_met, plot_cache_sizes, run_cells, table

    if args.full:
        args.workloads, args.sizes, args.seeds = list(FULL_WORKLOADS), [4, 16], [0, 1, 2]
        args.cache_sizes, args.loads = [2048, 4096, 8192, 16384], [0.6, 0.9, 1.2]
    out_dir = Path(args.output_dir) if args.output_dir else None
    rows = dict(ROUTING_ROWS)
    if args.kv_params:  # a variant in the default row's place (the goal column is then the variant's verdict)
        from coordinator.scheduling import create_policy

        try:
            params = json.loads(args.kv_params)
            create_policy("kv_affinity", params)
        except ValueError as e:  # a JSONDecodeError is one too
            raise SystemExit(f"--kv-params: {e}") from None
        rows["kv_affinity"] = ("kv_affinity", params)
    results = []
    for w in args.workloads:  # one workload at a time, the table rewritten after each (long runs)
        cells = [
            Cell(w, n, load, seed, blocks)
            for n in args.sizes
            for blocks in args.cache_sizes
            for load in args.loads
            for seed in args.seeds
        ]
        results += run_cells(
            cells, rows, args.warm, args.warmup, engine(args), _token_ids(), args.max_input,
            args.max_output, args.workers, progress,
        )  # fmt: skip
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "fleet-routing.partial.md").write_text(table(results) + "\n")
    met, blocks = goals_met(results)
    if out_dir is not None:
        (out_dir / "fleet-routing.partial.md").unlink(missing_ok=True)  # the whole table follows
        plot_cache_sizes(results, out_dir / "fleet-routing.png")
    head = (
        f"Routing quality in the fleet simulator: {args.warm} measured requests per run after {args.warmup} that "
        f"warm the caches; seeds {', '.join(map(str, args.seeds))} (Mooncake traces: successive windows of the "
        "trace; generated workloads: the generator's seed); load as a share of round robin's prefill capacity; "
        f"inputs <= {args.max_input}, outputs <= {args.max_output} tokens; NPU blocks of 16 tokens per engine "
        f"(ascend-910b) as in the table. {_signal_caption(args)}. TTFT in simulated ms, mean over seeds ± half "
        "their range; hit rate: prompt tokens found in the engines' prefix caches; ideal: one infinite cache; "
        "evictions: cached NPU blocks dropped from the first measured arrival to the end, per measured request; "
        "blocks held twice or more: share of the distinct blocks in the engines' caches that more than one engine "
        f"holds (sampled every {REPLICATION_EVERY} measured arrivals). Goal (kv_affinity row, Tandem's default): at "
        "least 10% lower mean and p99 TTFT than every other row on the reuse-heavy workloads; on the Mooncake "
        f"traces, no worse than the best peer on both. Met in {met} of {blocks} blocks."
        + (f" The kv_affinity row ran with `{args.kv_params}`, not its defaults." if args.kv_params else "")
    )
    return head + "\n\n" + table(results), results


def cmd_pd(args, progress=None) -> tuple[str, dict]:
    """Every P/D rule at its best P:D split against aggregated serving: on one trace (`--trace`), else on the grid
    of generated workloads and Mooncake traces at load levels."""
    from bench.fleet.links import Topology
    from bench.fleet.pd import PdConfig
    from bench.fleet.pd_bench import SWEEP_COST, cost_line, sweep, table
    from bench.fleet.pd_rules import RULES
    from bench.fleet.routing import ArrivalsWork, Cell, cell_arrivals

    for rule in args.rules:
        if rule not in RULES:
            raise SystemExit(f"--rules: {rule!r} is unknown; known: {', '.join(RULES)}")
    eng = engine(args)
    topo = Topology(args.nodes)
    slo = f"TTFT <= {args.ttft_slo_s:g} s and mean ITL <= {args.itl_slo_ms:g} ms"
    caption_tail = (
        f"{args.mode} mode, {args.nodes} node(s) (NIC {topo.nic_bandwidth / 1e9:g} GB/s, intra-node "
        f"{topo.intra_bandwidth / 1e9:g} GB/s), {args.npu_blocks} NPU blocks of 16 tokens per engine (ascend-910b); "
        "each rule at its best P:D split (most requests within the SLOs, then lowest mean TTFT; a quarter, half "
        "and three quarters of the fleet, then the best one's neighbours) "
        + (f"fixed at {args.prefill} prefill instances" if args.prefill else "among the splits tried")
        + f". mean, p99: TTFT in simulated ms; itl p99: p99 over requests of their mean inter-token latency (ms); "
        f"goodput: requests per simulated second with {slo}; bytes across nodes: GB of KV moved between nodes; "
        "hit rate: prompt tokens found in the prefix cache of the instance that computed the prompt; local share: "
        "requests a P/D rule served on one instance; most waiting: the largest queue (waiting requests) any instance "
        "reported; suggested: the coordinator's P:D sizing (`coordinator.capacity`) from the run's demand (prompt "
        "tokens computed, output tokens and mean context per second of arrivals) at the profile's step costs, the "
        "decode batch bounded by the ITL bound."
    )

    def base(n: int) -> PdConfig:
        return PdConfig(
            n,
            1,
            "aggregated",
            args.mode,
            eng,
            topo,
            ttft_slo_s=args.ttft_slo_s,
            itl_slo_s=args.itl_slo_ms / 1000,
        )

    if args.trace:
        bests = sweep(base(args.instances), workload(args), args.rules, args.prefill, args.workers, progress)
        head = (
            f"P/D rules in the fleet simulator, {args.instances} instances: {args.trace} trace, {args.requests} "
            f"requests (inputs <= {args.max_input}, outputs <= {args.max_output}), arrivals x{args.rate:g}, seed "
            f"{args.seed}; " + caption_tail
        )
        body = table({k: [v] for k, v in bests.items()}, args.instances)
        return f"{head}\n\n{body}\n\nCost: {cost_line(*SWEEP_COST)}", bests
    sections, summary = [], {}
    ids = _token_ids()
    for w in args.workloads:
        for n in args.sizes:
            for load in args.loads:
                per_rule: dict[str, list] = {}
                for seed in args.seeds:
                    arr, _, _ = cell_arrivals(
                        Cell(w, n, load, seed), args.requests, 0, eng, ids, args.max_input, args.max_output
                    )
                    work = ArrivalsWork(arr, seed)
                    for label, r in sweep(
                        base(n), work, args.rules, args.prefill, args.workers, progress
                    ).items():
                        per_rule.setdefault(label, []).append(r)
                summary[(w, n, load)] = per_rule
                sections.append(f"{_short(w)}, {n} instances, load {load:.0%}:\n\n" + table(per_rule, n))
    head = (
        f"P/D rules in the fleet simulator: {args.requests} requests per run; seeds "
        f"{', '.join(map(str, args.seeds))} (averaged); load as a share of round robin's prefill capacity over all "
        f"instances; inputs <= {args.max_input}, outputs <= {args.max_output} tokens; " + caption_tail
    )
    return head + "\n\n" + "\n\n".join(sections) + f"\n\nCost: {cost_line(*SWEEP_COST)}", summary


def _short(workload: str) -> str:
    from bench.fleet.routing import _short as short

    return short(workload)


def _token_ids() -> list[int]:
    from bench.fleet.runs import _token_ids as ids

    return ids()


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
        axes,
        ("mean TTFT (simulated ms)", "prefix hit rate (%)", "decision time (us per request)"),
        strict=True,
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
    p.add_argument(
        "--load-interval",
        type=float,
        default=None,
        help="engine load and progress report period, simulated s (default: 0.25, llm_d 0.05)",
    )
    p.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="processes (0: one per core)")
    p.add_argument(
        "--signal",
        choices=["counter", "first_token", "end"],
        default=None,
        help="how prefill leaves the ledger, for every policy (default: each policy's real system's)",
    )


def cmd_lora(args, progress=None) -> tuple[str, list]:
    from bench.fleet.lora import LoraSpec, LoraWorkload, run, table

    workloads = [
        LoraWorkload(
            adapters=a,
            instances=n,
            shifting=shifting,
            requests=n * args.requests_per_instance,
            warmup=n * args.requests_per_instance // 10,
            load=args.load,
            seed=args.seed,
        )
        for a in args.adapters
        for n in args.sizes
        for shifting in (False, True)
    ]
    lora = LoraSpec(max_loras=args.max_loras, load_s=args.load_s)
    results = run(workloads, lora, workers=args.workers, progress=progress)
    w = workloads[0]
    caption = (
        f"LoRA routing in the fleet simulator: Zipf(s={w.zipf_s:g}) adapter popularity (shifting: {w.phases} "
        f"phases of equal length, the adapters re-ranked at random at each new one), {args.requests_per_instance} requests per instance (the first tenth "
        f"warm up), each the adapter's {w.prefix_tokens}-token system prompt plus {w.suffix_tokens[0]}-"
        f"{w.suffix_tokens[1]} tokens of its own, {w.output_tokens} output tokens; Poisson arrivals at "
        f"{args.load:.0%} of the fleet's prefill capacity (every prompt token counted); {args.max_loras} adapter "
        f"slots per engine, a cold load stalls the engine {args.load_s:g} s; ascend-910b timing, 2048 NPU blocks "
        f"of 16 tokens per engine; seed {args.seed}. TTFT in simulated ms."
    )
    return caption + "\n\n" + table(results), results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("rows", "sweep", "scale", "validate", "signal", "routing", "pd"):
        s = sub.add_parser(name)
        add_arguments(s)
        s.add_argument("--output-dir", help="write fleet-<cmd>.md (and a plot for scale) here")
        if name == "scale":
            s.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512])
            s.add_argument("--base-instances", type=int, default=8, help="instances per copy of the trace")
            s.set_defaults(rate=2.5, requests=100)
        if name == "routing":
            # The defaults are the quick grid of `make bench`; --full is the whole sweep (hours on 2 cores).
            s.add_argument("--full", action="store_true", help="every workload, 4 and 16 instances, 3 seeds")
            s.add_argument(
                "--workloads", nargs="+", default=["tenants_rag", "sessions_agents", "conversation"]
            )
            s.add_argument("--sizes", type=int, nargs="+", default=[4])
            s.add_argument("--cache-sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
            s.add_argument("--loads", type=float, nargs="+", default=[0.6, 0.9, 1.2])
            s.add_argument("--seeds", type=int, nargs="+", default=[0])
            s.add_argument("--warm", type=int, default=1000, help="measured requests per run")
            s.add_argument("--warmup", type=int, default=200, help="requests before them (cache warm-up)")
            s.add_argument(
                "--kv-params",
                default="",
                help="JSON parameters for the kv_affinity row, e.g. '{\"load_weight\": 0.5}'",
            )
        if name == "pd":
            from bench.fleet.pd_rules import RULES

            s.add_argument("--nodes", type=int, default=2, help="nodes the instances are spread over")
            s.add_argument(
                "--prefill", type=int, default=None, help="prefill instances (default: each rule's best)"
            )
            s.add_argument("--mode", choices=["handoff", "trigger"], default="handoff")
            s.add_argument("--rules", nargs="+", default=list(RULES))
            s.add_argument(
                "--workloads", nargs="+", default=["tenants_rag", "sessions_agents", "conversation"],
                help="grid mode (without --trace)",
            )  # fmt: skip
            s.add_argument("--sizes", type=int, nargs="+", default=[8], help="instances (grid mode)")
            s.add_argument("--loads", type=float, nargs="+", default=[0.6, 0.9], help="grid mode")
            s.add_argument("--seeds", type=int, nargs="+", default=[0], help="grid mode")
            s.add_argument("--ttft-slo-s", type=float, default=2.0, help="goodput's TTFT bound")
            s.add_argument("--itl-slo-ms", type=float, default=50.0, help="goodput's mean ITL bound")
            s.set_defaults(trace=None, instances=8, requests=1000)
        if name == "validate":
            s.add_argument(
                "--speedup", type=float, default=2.0, help="simengine --speedup of the real-time side"
            )
            s.add_argument("--match-timeout-ms", type=float, default=200.0)
            s.add_argument(
                "--jitter-ms", type=float, default=5.0, help="routing jitter of the sensitivity runs"
            )
            s.add_argument("--jitter-runs", type=int, default=4)
            s.add_argument("--rows", nargs="+", default=["round_robin", "kv_affinity", "sglang_cache_aware"])
            s.set_defaults(instances=2, rate=0.625, requests=150)
    s = sub.add_parser(
        "overload", help="SLO-aware admission: priority chat and flex batch, steady then a burst"
    )
    s.add_argument("--instances", type=int, default=4)
    s.add_argument("--steady", type=float, default=0.8, help="steady load, a share of capacity")
    s.add_argument(
        "--bursts", type=float, nargs="+", default=[0.8, 1.5, 3.0], help="burst loads (0.8: no burst)"
    )
    s.add_argument("--steady-s", type=float, default=60.0)
    s.add_argument("--burst-s", type=float, default=30.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--mixed", action="store_true", help="half the instances at half speed (fleet-overload-mixed.md)"
    )
    s.add_argument(
        "--peers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the peers' admission rows (llm-d, Dynamo: bench.fleet.peer_admission)",
    )
    s.add_argument("--workers", type=int, default=0, help="processes (0: one per core)")
    s.add_argument("--output-dir", help="write fleet-overload.md here")
    s.add_argument("--plot", help="write a PNG of TTFT against arrival time during the largest burst here")
    s.set_defaults(signal=None)
    s = sub.add_parser("lora", help="LoRA adapters: Zipf popularity, slots, cold loads; four routers")
    s.add_argument("--adapters", type=int, nargs="+", default=[50, 500])
    s.add_argument("--sizes", type=int, nargs="+", default=[8, 32], help="instances")
    s.add_argument("--requests-per-instance", type=int, default=150, help="requests per instance of a run")
    s.add_argument("--max-loras", type=int, default=4, help="adapter slots per engine")
    s.add_argument("--load-s", type=float, default=0.25, help="seconds one adapter load stalls the engine")
    s.add_argument("--load", type=float, default=0.6, help="arrivals: share of prefill capacity")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--workers", type=int, default=0)
    s.add_argument("--output-dir", help="write fleet-lora.md here")
    s.set_defaults(signal=None)
    args = parser.parse_args(argv)

    from tqdm import tqdm

    total = {"rows": len(POLICY_ROWS)}.get(args.cmd)
    with tqdm(total=total, desc=f"fleet {args.cmd}", unit="run", file=sys.stderr) as bar:
        if args.cmd == "rows":
            text, _ = cmd_rows(args, bar.update)
        elif args.cmd == "sweep":
            text, _ = cmd_sweep(args, bar.update)
        elif args.cmd == "validate":
            text, _ = cmd_validate(args, bar.update)
        elif args.cmd == "signal":
            text, _ = cmd_signal(args, bar.update)
        elif args.cmd == "routing":
            text, _ = cmd_routing(args, bar.update)
        elif args.cmd == "pd":
            text, _ = cmd_pd(args, bar.update)
        elif args.cmd == "lora":
            text, _ = cmd_lora(args, bar.update)
        elif args.cmd == "overload":
            from bench.fleet.overload import cmd_overload

            text, _ = cmd_overload(args, bar.update)
        else:
            text, rows = cmd_scale(args, bar.update)
    print(text)
    if args.output_dir:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        suffix = f"-{args.signal}" if args.signal else "-mixed" if getattr(args, "mixed", False) else ""
        (out / f"fleet-{args.cmd}{suffix}.md").write_text(text + "\n")
        if args.cmd == "scale":
            plot_scale(rows, out / "fleet-scale.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
