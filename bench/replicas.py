"""Decision throughput with 1, 2 and 4 coordinator replicas, side by side on one machine.

    python -m bench.replicas [--replicas 1 2 4] [--seconds 15] [--clients 16] [--output FILE]

Each configuration is a whole mesh (`tandem up`: three simengines, Envoy, conductor, N coordinator replicas sharing
an etcd when N > 1); clients send streaming completions of one token, so the engines are not the bottleneck and the
decision path is. Reported: requests per second served, failures, and the CPU seconds the coordinator processes
used per 1,000 requests (from /proc). All configurations run in one invocation, one after the other, on the same
machine: compare them with each other, not with another machine.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.chaos import UpProcess, wait
from bench.harness import Etcd, mesh_config
from bench.steady_load import SteadyLoad


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc/<pid>/stat."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(replicas: int, seconds: float, clients: int, workdir: Path) -> dict[str, float]:
    etcd = None
    config = mesh_config(engines=3, engine_args=["--speedup", "1000"])
    if replicas > 1:
        etcd = Etcd(workdir / "etcd")
        etcd.start()
        config["coordinator"].update(replicas=replicas, etcd={"endpoint": etcd.endpoint, "prefix": "/bench"})
    up = UpProcess(config, workdir)
    up.start()
    try:
        wait(lambda: len(up.healthy_instances()) == 3, 60, "engines registered on every replica")
        names = ["coordinator"] if replicas == 1 else [f"coordinator-c{i}" for i in range(replicas)]
        pids = [up.pid(n) for n in names]
        load = SteadyLoad(up.http, "tandem-sim", clients=clients, max_tokens=1, timeout_s=30).start()
        try:
            time.sleep(2.0)  # warm-up
            start, cpu0 = time.monotonic(), sum(cpu_seconds(p) for p in pids)
            time.sleep(seconds)
            end, cpu1 = time.monotonic(), sum(cpu_seconds(p) for p in pids)
        finally:
            load.stop()
        report = load.report(start, end)
        return {
            "replicas": replicas,
            "rps": report.ok / (end - start),
            "failed": report.failed,
            "cpu_per_1k": 1000 * (cpu1 - cpu0) / max(1, report.ok),
        }
    finally:
        up.stop()
        if etcd is not None:
            etcd.stop()


def table(rows: list[dict[str, float]]) -> str:
    lines = [
        "| coordinator replicas | requests/s | failed | coordinator CPU s per 1,000 requests |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['replicas']} | {r['rps']:.0f} | {r['failed']} | {r['cpu_per_1k']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    if any(n > 1 for n in args.replicas) and shutil.which("etcd") is None:
        print("etcd not installed: apt-get install -y etcd-server etcd-client", file=sys.stderr)
        return 2
    rows = []
    for n in args.replicas:
        with tempfile.TemporaryDirectory(prefix=f"tandem-replicas-{n}-") as tmp:
            rows.append(measure(n, args.seconds, args.clients, Path(tmp)))
    text = table(rows)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
