"""P/D in real time against aggregated serving, and the fleet simulator's prediction of each row.

    python -m bench.pd [--requests 120] [--speedup 2.5] [--prefill 2] [--decode 2] [--rows ...]
                       [--output docs/bench/pd.md]

Each row gets a fresh mesh of simengines on one node and replays the same seeded slice of a trace through Envoy:
`aggregated` runs every engine hybrid under `kv_affinity` (prefill + decode engines in all); a P/D row
(`<mode> <choice>`) runs `--prefill` prefill and `--decode` decode engines in handoff (prefill first, NixlConnector)
or trigger mode (decode first, MooncakeLayerwiseConnector) with the coordinator's `scheduler.pd_choice`
(`separate`: prefill by `kv_affinity`, decode by least load; `joint`: the pair by predicted TTFT; `adaptive`: joint,
or the decode engine alone when sooner). The fleet simulator (`bench.fleet.pd`) then replays the same slice with
the same engines, split and rule (`simulate_row`), so every row is both a measurement and a check of the
simulator (issue 21: within 10% on mean TTFT). Printed: TTFT p50/p90/p99/mean per row (simulated ms) and, for
trigger rows, the callback path the coordinator measures, from the decode request leaving it to the prefill leg
going out (decode engine allocation, metaserver POST through Envoy's JSON transcoding, callback handling), p50/p99
from its histogram (wall ms).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.fleet.instance import EngineSpec
from bench.fleet.links import Topology
from bench.fleet.pd import PdConfig, PdResult, simulate_pd
from bench.fleet.runs import Workload, _token_ids
from bench.harness import mesh_config
from bench.replay import replay
from bench.trace import load_trace
from mesh.config import parse_mesh_config
from mesh.up import Mesh
from simengine.profiles import PROFILES
from tandem.tokenizer import load_tokenizer
from tandem.version import __version__

MODES = {"handoff": ("prefill_handoff_decode", "NixlConnector"),
         "trigger": ("concurrent_engine_sync", "MooncakeLayerwiseConnector")}  # fmt: skip
#: The simulator's rule for each `scheduler.pd_choice` (`bench.fleet.pd_rules`).
CHOICES = {"separate": "tandem_least_load", "joint": "tandem_joint", "adaptive": "tandem_adaptive"}
ROWS = ("aggregated", *(f"{m} {c}" for m in MODES for c in CHOICES))
#: `make bench`'s rows (about 45 s each at the default speedup): aggregated, both modes, and each choice once (on one
#: node `joint` differs from `separate` only by the decode engine's first step: `--rows` runs the others).
DEFAULT_ROWS = ("aggregated", "handoff separate", "handoff adaptive", "trigger joint")
CALLBACK = "tandem_coordinator_trigger_callback_path_seconds"
CHOICES_TOTAL = "tandem_coordinator_pd_choices_total"
#: simengine's default `--npu-blocks` (the engines here run with their defaults).
SIMENGINE_NPU_BLOCKS = 4096
#: The node agents' engine load report period in `bench.harness.mesh_config` meshes, wall seconds.
LOAD_INTERVAL_WALL_S = 0.25


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


def coordinator_metrics(metrics_address: str) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """The trigger callback path's histogram buckets (le, count) and the P/D choices by kind, from the coordinator."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    buckets, choices = [], {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == CALLBACK + "_bucket":
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name == CHOICES_TOTAL:
                choices[s.labels["choice"]] = choices.get(s.labels["choice"], 0.0) + s.value
    return sorted(buckets), choices


def local_share(choices: dict[str, float]) -> float:
    """Share of P/D choices that served the request on one instance (nan when none was made)."""
    total = sum(choices.values())
    return choices.get("local", 0.0) / total if total else float("nan")


def split_row(row: str) -> tuple[str | None, str]:
    """(mode, choice) of a row; (None, "aggregated") for the aggregated one."""
    if row == "aggregated":
        return None, row
    mode, choice = row.split()
    return mode, choice


def simulate_row(row: str, args, callback_wall_s: float) -> PdResult:
    """The same slice, engines, split and rule in the fleet simulator (`bench.fleet.pd`), in simulated time: the
    engines' defaults (simengine's 4,096 NPU blocks), one node whose link runs at the timing profile's transfer
    bandwidth (simengine sleeps each transfer on its own at that rate; the simulator shares the link among
    transfers in flight, which at a transfer of 30 simulated ms or less rarely overlap), load reports every
    0.25 wall s and the trigger callback's measured wall time, both scaled by the speedup."""
    mode, choice = split_row(row)
    engine = EngineSpec(npu_blocks=SIMENGINE_NPU_BLOCKS)
    bandwidth = PROFILES[engine.profile].transfer_bandwidth
    cfg = PdConfig(
        instances=args.prefill + args.decode,
        prefill=args.prefill,
        rule=CHOICES.get(choice, "aggregated"),
        mode=mode or "handoff",
        engine=engine,
        topology=Topology(nodes=1, intra_bandwidth=bandwidth, intra_latency_s=0.0),
        load_interval_s=LOAD_INTERVAL_WALL_S * args.speedup,
        callback_s=callback_wall_s * args.speedup,
    )
    work = Workload(args.trace, args.requests, args.time_scale / args.speedup, args.max_input, args.max_output,
                    args.seed)  # fmt: skip
    return simulate_pd(cfg, work.arrivals(), _token_ids(), args.seed)


def run_row(row: str, args, requests, workdir: Path):
    """One fresh mesh for `row`, the replay through Envoy, the callback path's buckets (trigger rows) and the
    coordinator's P/D choices by kind."""
    mode, choice = split_row(row)
    n = args.prefill + args.decode
    config = mesh_config(engines=n, engine_args=["--speedup", str(args.speedup)], policy="kv_affinity")
    if mode is not None:
        pd_mode, connector = MODES[mode]
        roles = [(f"prefill-{i}", "prefill") for i in range(args.prefill)]
        roles += [(f"decode-{i}", "decode") for i in range(args.decode)]
        for engine, (iid, role) in zip(config["node_agents"][0]["engines"], roles, strict=True):
            engine.update(instance_id=iid, role=role, kv_connector=connector)
        config["coordinator"]["pd_mode"] = pd_mode
        config["coordinator"]["scheduler"]["pd_choice"] = choice
    config["envoy"]["log_level"] = "error"
    name = row.replace(" ", "-")
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    mesh = Mesh(parse_mesh_config(config, str(path)), str(path), workdir / f"run-{name}")
    try:
        mesh.start()
        missing = mesh.wait_for_engines(60)
        if missing:
            raise RuntimeError(f"engines not healthy: {missing}")
        url = f"http://{config['envoy']['http_listen']}/v1/completions"
        result = asyncio.run(replay(url, "tandem-sim", requests))
        buckets, choices = coordinator_metrics(config["coordinator"]["metrics_listen"])
    finally:
        mesh.stop()
    return result, (buckets if mode == "trigger" else []), choices


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default="conversation")
    parser.add_argument("--requests", type=int, default=120)
    # Speedup 2.5 and arrivals / 1 are the simulated load of the earlier speedup 5 and arrivals / 2, with the
    # mesh's own wall-clock costs (Envoy, the coordinator, HTTP, the client) magnified half as much in simulated
    # time: at speedup 5 they put the real side 7-15% above the simulator on mean TTFT, at 2.5 within 5% except
    # `adaptive`'s row (docs/pd.md, "The simulator against the real-time mesh").
    parser.add_argument("--time-scale", type=float, default=1.0, help="arrivals compressed by this factor")
    parser.add_argument("--speedup", type=float, default=2.5, help="simengine --speedup")
    parser.add_argument("--max-input", type=int, default=4096)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill", type=int, default=2, help="prefill engines of the P/D rows")
    parser.add_argument("--decode", type=int, default=2, help="decode engines of the P/D rows")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(DEFAULT_ROWS), metavar="ROW",
                        help=f"rows to run, of: {', '.join(ROWS)}")  # fmt: skip
    parser.add_argument("--output", help="also write the markdown table here")
    args = parser.parse_args(argv)

    requests = load_trace(args.trace, args.requests, args.time_scale, load_tokenizer(None), args.seed,
                          args.max_input, args.max_output)  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="tandem-pd-"))
    k = args.speedup * 1000  # wall seconds -> simulated ms
    rows, verdicts, callbacks = [], [], []
    load_before = os.getloadavg()[0]
    for row in args.rows:
        print(f"P/D {row}: replaying {len(requests)} requests", file=sys.stderr, flush=True)
        result, buckets, choices = run_row(row, args, requests, workdir)
        t = result.ttft_s
        real = [result.pct(t, q) * k for q in (50, 90, 99)] + [statistics.fmean(t) * k if t else float("nan")]
        callback = [histogram_quantile(buckets, q) * 1000 for q in (0.5, 0.99)] if buckets else []
        if callback:
            callbacks.append(f"{row}: p50 {callback[0]:.2f}, p99 {callback[1]:.2f} over {buckets[-1][1]:.0f}")
        sim = simulate_row(row, args, callback[0] / 1000 if callback and not math.isnan(callback[0]) else 0.0)
        simv = [sim.pct(q) * 1000 for q in (50, 90, 99)] + [sim.mean_ttft * 1000]
        diff = [(a - b) / b if b else float("nan") for a, b in zip(simv, real, strict=True)]
        shares = (local_share(choices), sim.local / sim.measured if sim.measured else float("nan"))
        local = ["-" if row == "aggregated" or math.isnan(v) else f"{v:.2f}" for v in shares]
        rows += [
            f"| {row} | real-time mesh | "
            + " | ".join(f"{v:.0f}" for v in real)
            + f" | {local[0]} | {result.errors} |",
            f"| {row} | fleet simulator | " + " | ".join(f"{v:.0f}" for v in simv) + f" | {local[1]} | |",
            f"| {row} | difference | " + " | ".join(f"{d:+.0%}" for d in diff) + " | | |",
        ]
        verdicts.append(
            f"{row} {diff[3]:+.1%}" + (" (within 10%)" if abs(diff[3]) <= 0.10 else " (more than 10%)")
        )
    load_after = os.getloadavg()[0]
    n = args.prefill + args.decode
    lines = [
        f"P/D against aggregated serving: {args.trace} trace, first {len(requests)} requests (inputs <= "
        f"{args.max_input} tokens, outputs <= {args.max_output}), arrivals / {args.time_scale:g}, {n} simengines "
        f"(speedup {args.speedup:g}) on one node: all hybrid (aggregated, kv_affinity) or {args.prefill} prefill + "
        f"{args.decode} decode; tandem {__version__}, {platform.machine()} {os.cpu_count()} cores; load average "
        f"(1 min) before / after {load_before:.2f} / {load_after:.2f}. TTFT in simulated ms (real time x speedup). "
        "Fleet simulator: the same slice, engines, split and rule, scaled as `bench.pd.simulate_row` says. Served "
        "locally: the share of P/D choices that kept a request on one instance (the coordinator's "
        "`tandem_coordinator_pd_choices_total`, which counts `joint` and `adaptive` choices only; the simulator's "
        "measured requests).",
        "",
        "| row | source | TTFT p50 | p90 | p99 | mean | served locally | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "Simulator against the mesh on mean TTFT: " + "; ".join(verdicts) + ".",
        "",
        "Trigger callback path (decode request out to prefill leg out, wall ms, from the coordinator's histogram): "
        + ("; ".join(callbacks) + " callbacks." if callbacks else "none."),
    ]
    table = "\n".join(lines)
    print(table)
    if args.output:
        Path(args.output).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
