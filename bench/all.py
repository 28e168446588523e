"""`make bench`: every benchmark at a size that fits 2 cores in about 50 minutes, then `docs/benchmarks.md`.

    python -m bench.all [--docs docs] [--only overhead policies ...]

Each step is the command shown in the report, run as a subprocess (its progress bars on stderr); the pieces it
writes under `docs/bench/` are assembled into `docs/benchmarks.md` with the machine, versions and run times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.harness import envoy_version
from bench.peers import version as peer_version
from tandem.version import __version__

PY = "python"  # shown in the report; run with sys.executable


def _pressure_replay(load: str, out: str) -> list[str]:
    """The cache-pressure replay (4 engines of 1,024 blocks, the held-out tenants_rag population, the peer routers,
    three runs per row) at `load` of round robin's capacity, written under `{out}/<out>`."""
    return [
        *"bench.policies --trace tenants_rag --seed 7 --requests 400 --npu-blocks 1024 --speedup 5".split(),
        *f"--match-timeout-ms 100 --load {load} --repeats 3 --output-dir {{out}}/{out}".split(),
        *["--policies", "kv_affinity", "sglang-router cache_aware", "vllm-router cache_aware"],
    ]


#: (name, title, argv after `python -m`, markdown piece it writes or None to keep its stdout)
STEPS: list[tuple[str, str, list[str], str | None]] = [
    (
        "overhead",
        "Overhead: direct, Tandem and the peer routers",
        ["bench.overhead", "--output", "{out}/overhead.md", "--plot", "{out}/overhead.png"],
        "overhead.md",
    ),
    (
        "envoy_cost",
        "What each part of Envoy's path costs: the mesh's configuration with one part taken out at a time",
        ["bench.envoy_cost", "--requests", "1500", "--output", "{out}/envoy-cost.md"],
        "envoy-cost.md",
    ),
    (
        "profile",
        "Where the mesh's CPU goes per request: py-spy under the overhead benchmark's load",
        ["bench.profile", "--output", "{out}/profile.md"],
        "profile.md",
    ),
    (
        "decision_stall",
        "Decision path: one huge prompt among many small ones",
        ["bench.decision_stall", "--output", "{out}/decision-stall.md"],
        "decision-stall.md",
    ),
    (
        "mtls",
        "Mutual TLS between components: cost per request",
        ["bench.mtls", "--requests", "4000", "--rounds", "8", "--output", "{out}/mtls.md"],
        "mtls.md",
    ),
    (
        "kv_relay",
        "KV events relayed and indexed: blocks per second and CPU per million blocks",
        ["bench.kv_relay", "--output", "{out}/kv-relay.md"],
        "kv-relay.md",
    ),
    (
        "signal",
        "The load signal: ledger prefill against the true queued prefill, and its drift",
        ["bench.fleet", "signal", "--output-dir", "{out}"],
        "fleet-signal.md",
    ),
    (
        "sglang_parity",
        "SGLang's router as shipped against its re-implementation: the same decisions?",
        ["bench.sglang_parity", "--output-dir", "{out}"],
        "sglang-parity.md",
    ),
    (
        "routing",
        "Routing quality per workload, cache size and load: every policy (quick grid; `--full` for the sweep)",
        ["bench.fleet", "routing", "--warm", "500", "--output-dir", "{out}"],
        "fleet-routing.md",
    ),
    (
        "policies",
        "Trace replay through the mesh and the peer routers",
        ["bench.policies", "--speedup", "5", "--match-timeout-ms", "100", "--output-dir", "{out}"],
        "policies.md",
    ),
    (
        "policies_pressure",
        "Trace replay under cache pressure: small engine caches, heavy load, three runs per row",
        _pressure_replay("0.5", "pressure"),
        "pressure/policies.md",
    ),
    (
        "policies_pressure_moderate",
        "Trace replay under cache pressure at half that load: the same engines and population, three runs per row",
        _pressure_replay("0.25", "pressure-moderate"),
        "pressure-moderate/policies.md",
    ),
    (
        "sli",
        "Routing-quality SLI: predicted against delivered cache hits per instance on the held-out reuse workload",
        ["bench.sli", "--requests", "400", "--output", "{out}/sli.md"],
        "sli.md",
    ),
    (
        "pd",
        "P/D in real time against aggregated serving, and the fleet simulator's prediction of each row",
        ["bench.pd", "--output", "{out}/pd.md"],
        "pd.md",
    ),
    (
        "validate",
        "Fleet simulator validation against the real-time mesh",
        ["bench.fleet", "validate", "--output-dir", "{out}"],
        "fleet-validate.md",
    ),
    (
        "fleet_pd",
        "P/D in the fleet simulator: every P/D rule at its best P:D split against aggregated serving",
        ["bench.fleet", "pd", "--sizes", "4", "--nodes", "2", "--requests", "300", "--output-dir", "{out}"],
        "fleet-pd.md",
    ),
    (
        "overload",
        "Past saturation: service tiers and SLO-aware admission during bursts, against the peers' admission "
        "(`--bursts 0.8 1.5 3` for the steady baseline too)",
        [
            "bench.fleet",
            "overload",
            "--bursts",
            "1.5",
            "3",
            "--output-dir",
            "{out}",
            "--plot",
            "{out}/fleet-overload.png",
        ],
        "fleet-overload.md",
    ),
    (
        "overload_mixed",
        "Past saturation on a mixed fleet: the same bursts with half the instances at half speed",
        ["bench.fleet", "overload", "--bursts", "1.5", "3", "--mixed", "--output-dir", "{out}"],
        "fleet-overload-mixed.md",
    ),
    (
        "lora",
        "LoRA adapters in the fleet simulator: Zipf popularity over 50 and 500 adapters, slots and cold loads "
        "(8 instances; `--sizes 8 32` for 32 too)",
        ["bench.fleet", "lora", "--sizes", "8", "--output-dir", "{out}"],
        "fleet-lora.md",
    ),
    (
        "scale",
        "Fleet scale: 8, 64 and 512 instances",
        ["bench.fleet", "scale", "--output-dir", "{out}"],
        "fleet-scale.md",
    ),
    (
        "replicas",
        "Decision throughput with 1, 2 and 4 coordinator replicas",
        ["bench.replicas", "--seconds", "15", "--output", "{out}/replicas.md"],
        "replicas.md",
    ),
    (
        "chaos",
        "Chaos soak: a fault every 20 s for 5 minutes on three loopback nodes (`--duration 600` for the long soak)",
        ["bench.chaos", "--gap", "20", "--duration", "300", "--output", "{out}/chaos.md"],
        "chaos.md",
    ),
    (
        "simengine",
        "Simulated engine: streamed tokens/s and timing model",
        ["bench.simengine_bench", "--seconds", "5", "--runs", "2"],
        None,
    ),
    (
        "conductor",
        "Conductor index: ingest, Match latency, memory",
        ["bench.conductor_bench", "--quick"],
        None,
    ),
]

#: The order the steps run in (the report keeps STEPS' order): the real-time steps first, while the machine is quiet;
#: the replicas step (four coordinators saturating both cores) just before the profile and the simulator's steps,
#: whose results do not depend on the load average (the profile reports shares of each process's samples), so that
#: its load has decayed by the next real-time step; the chaos soak (about 20 processes) last, with nothing after it
#: to wait for the load it leaves.
RUN_ORDER = [
    "overhead", "envoy_cost", "decision_stall", "mtls", "sglang_parity", "policies", "policies_pressure",
    "policies_pressure_moderate", "sli", "pd", "validate",
    "simengine", "conductor", "kv_relay", "replicas", "profile", "signal", "routing", "fleet_pd", "overload",
    "overload_mixed", "lora",
    "scale", "chaos",
]  # fmt: skip

#: Lines of a failed step's stderr kept (printed and written to `<step>.stderr.txt` beside its stdout).
STDERR_TAIL_LINES = 40

#: Steps timed on the wall clock (engines, meshes, routers, real-time replays): each starts only once the load
#: average has fallen to SETTLED_LOAD (the simulator's steps keep both cores busy), waiting at most `--settle-s`.
REAL_TIME = {
    "overhead", "envoy_cost", "decision_stall", "mtls", "policies", "policies_pressure", "policies_pressure_moderate",
    "sli", "pd", "validate", "replicas",
    "chaos", "simengine", "conductor", "kv_relay",
}  # fmt: skip
SETTLED_LOAD = 1.0

PLOTS = {
    "overhead": "overhead.png",
    "policies": "policies.png",
    "scale": "fleet-scale.png",
    "routing": "fleet-routing.png",
    "policies_pressure": "pressure/policies.png",
    "policies_pressure_moderate": "pressure-moderate/policies.png",
    "overload": "fleet-overload.png",
}


def settle(limit_s: float, poll_s: float = 2.0) -> float:
    """Waits until the 1-minute load average is at most SETTLED_LOAD, or `limit_s`; returns the load average."""
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] > SETTLED_LOAD and time.monotonic() < deadline:
        time.sleep(poll_s)
    return round(os.getloadavg()[0], 2)


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: every state but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its descendants that have ended and been waited for (a step's processes,
    once it is over)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _run_position(step: tuple) -> int:
    """Where a step runs: its place in RUN_ORDER (a step missing there runs after the others, in STEPS' order)."""
    return RUN_ORDER.index(step[0]) if step[0] in RUN_ORDER else len(RUN_ORDER)


def run_step(argv: list[str]) -> tuple[int, str, str]:
    """Runs `python -m <argv>`: its exit code, its stdout, and the last `STDERR_TAIL_LINES` lines of its stderr, which
    is also passed through as it comes (progress bars included)."""
    proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    chunks: list[bytes] = []
    tail = bytearray()

    def pump_stderr() -> None:
        assert proc.stderr is not None
        while chunk := proc.stderr.read1(65536):
            sys.stderr.buffer.write(chunk)
            sys.stderr.buffer.flush()
            tail.extend(chunk)
            del tail[: max(0, len(tail) - 65536)]

    pump = threading.Thread(target=pump_stderr, daemon=True)
    pump.start()
    while chunk := proc.stdout.read1(65536):
        chunks.append(chunk)
    returncode = proc.wait()
    pump.join()
    lines = tail.decode(errors="replace").replace("\r", "\n").splitlines()
    kept = [line for line in lines if line.strip()][-STDERR_TAIL_LINES:]
    return returncode, b"".join(chunks).decode(errors="replace"), "\n".join(kept) + "\n"


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def machine() -> list[tuple[str, str]]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    envoy = envoy_version()
    return [
        ("date (UTC)", datetime.now(UTC).strftime("%Y-%m-%d %H:%M")),
        ("CPU", f"{cpu}, {os.cpu_count()} cores"),
        ("memory", mem),
        ("load average at start (other work on the machine)", " ".join(f"{x:.2f}" for x in os.getloadavg())),
        ("OS / Python", f"{platform.system()} {platform.release()} / {platform.python_version()}"),
        ("tandem", __version__),
        ("Envoy", envoy[:80] or "n/a"),
        ("sglang-router", peer_version("sglang")),
        ("vllm-router", peer_version("vllm")),
        ("git commit", _run(["git", "rev-parse", "--short", "HEAD"]) or "n/a"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--docs", default="docs", help="where benchmarks.md and bench/ go")
    parser.add_argument("--only", nargs="+", choices=[s[0] for s in STEPS], help="run only these steps")
    parser.add_argument(
        "--record",
        nargs=3,
        action="append",
        default=[],
        metavar=("STEP", "SECONDS", "COMMAND"),
        help="record a step run by hand (its piece already written under docs/bench) instead of running it",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=180.0,
        help=f"longest wait for the load average to fall to {SETTLED_LOAD} before a real-time step",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="run nothing: rewrite the report from the last outputs"
    )
    args = parser.parse_args(argv)
    docs = Path(args.docs)
    out = docs / "bench"
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    if args.report_only:  # nothing ran: the figures come from the steps' own runs (dates and loads per step)
        info = [
            (k + " (report rewritten, nothing run)" if k.startswith(("date", "load")) else k, v)
            for k, v in info
        ]
    meta_path = out / "steps.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    total0 = time.monotonic()
    failed: list[str] = []
    for name, seconds, command in args.record:
        meta[name] = {
            "command": command,
            "seconds": float(seconds),
            "exit": 0,
            "finished": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
            "load_after": round(os.getloadavg()[0], 2),
        }
        (out / f"{name}.stdout.txt").write_text("")
    if args.record:
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        args.only = args.only or [name for name, _, _ in args.record]
    for name, title, argv_tpl, _piece in sorted(STEPS, key=_run_position):
        if (
            args.report_only
            or (args.only and name not in args.only)
            or any(r[0] == name for r in args.record)
        ):
            continue
        argv_ = [a.replace("{out}", str(out)) for a in argv_tpl]
        shown = " ".join([PY, "-m", *map(shlex.quote, argv_)])
        if name in REAL_TIME:
            waited = time.monotonic()
            load_before = settle(args.settle_s)
            waited = time.monotonic() - waited
        else:
            load_before, waited = round(os.getloadavg()[0], 2), 0.0
        print(
            f"== {title}: {shown} (load average {load_before}, after {waited:.0f} s settling)",
            file=sys.stderr,
            flush=True,
        )
        t0, busy0, own0 = time.monotonic(), busy_cpu_s(), own_cpu_s()
        returncode, stdout, stderr_tail = run_step(argv_)
        elapsed = time.monotonic() - t0
        # The machine's busy CPU that was not the step's: other work running beside it.
        others = max(0.0, (busy_cpu_s() - busy0) - (own_cpu_s() - own0)) / max(elapsed, 1e-9)
        (out / f"{name}.stdout.txt").write_text(stdout)
        stderr_path = out / f"{name}.stderr.txt"
        stderr_path.unlink(missing_ok=True)
        if returncode != 0:
            stderr_path.write_text(stderr_tail)
            print(f"== {name} failed; the end of its stderr:\n{stderr_tail}", file=sys.stderr, flush=True)
        meta[name] = {
            "command": shown,
            "seconds": round(elapsed, 1),
            "exit": returncode,
            "finished": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
            "load_before": load_before,
            "settled_s": round(waited),
            "load_after": round(os.getloadavg()[0], 2),
            "others_cores": round(others, 2),
        }
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        print(
            f"== {name}: exit {returncode}, {meta[name]['seconds']:.0f} s, load average "
            f"{load_before} -> {meta[name]['load_after']}",
            file=sys.stderr,
            flush=True,
        )
        if returncode != 0:
            failed.append(name)
    total = time.monotonic() - total0
    sections = []
    for name, title, _, piece in STEPS:
        if name not in meta:
            continue
        m = meta[name]
        stdout = (out / f"{name}.stdout.txt").read_text() if (out / f"{name}.stdout.txt").exists() else ""
        if m["exit"] != 0:
            body = f"**This step failed (exit {m['exit']}); its output:**\n\n```\n{stdout.strip()}\n```"
        elif piece is not None and (out / piece).exists():
            body = (out / piece).read_text().strip()
        else:
            body = "```\n" + stdout.strip() + "\n```"
        plot = PLOTS.get(name)
        if plot and (out / plot).exists() and m["exit"] == 0:
            body += f"\n\n![{title}](bench/{plot})"
        sections.append((name, title, m, body))
    write_report(docs / "benchmarks.md", info, sections, total, args.only)
    print(f"wrote {docs / 'benchmarks.md'} ({total / 60:.1f} min of benchmarks this run)", file=sys.stderr)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def write_report(path: Path, info, sections, total: float, only) -> None:
    from bench.report import INTRO, notes

    lines = [INTRO, "", "## Machine and versions", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in info]
    all_minutes = sum(m["seconds"] + m.get("settled_s", 0) for _, _, m, _ in sections) / 60
    lines += [
        "",
        f"`make bench` (`python -m bench.all`) runs the steps below, {all_minutes:.1f} minutes in all as last run, "
        f"waits for the load average to settle at {SETTLED_LOAD:g} included"
        + (f" (this report's last invocation re-ran only: {', '.join(only)})" if only else "")
        + ". A real-time step that began above it is marked: its timings are not a result. Other work: the cores the "
        "machine spent busy during the step on anything but the step's own processes (its load average after counts "
        "both; a process the step leaves to init, as the chaos soak's engines that outlive a killed agent, counts as "
        "other work).",
        "",
        "| step | command | minutes (+ settling) | finished (UTC) | load average before / after | other work (cores) |",
        "|---|---|---:|---|---:|---:|",
    ]
    for name, title, m, _ in sections:
        before = m.get("load_before", "n/a")
        unsettled = name in REAL_TIME and isinstance(before, float | int) and before > SETTLED_LOAD
        lines.append(
            f"| {title} | `{m['command']}` | {m['seconds'] / 60:.1f} (+{m.get('settled_s', 0) / 60:.1f}) "
            f"| {m['finished']} | {before}{' **(unsettled)**' if unsettled else ''} / {m['load_after']} "
            f"| {m.get('others_cores', '-')} |"
        )
    for name, title, m, body in sections:
        lines += ["", f"## {title}", "", f"`{m['command']}` ({m['seconds']:.0f} s)", ""]
        note = notes(name, body)
        if note:
            lines += [note, ""]
        lines.append(body)
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
