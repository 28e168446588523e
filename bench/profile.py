"""Where the mesh's CPU goes per request: py-spy samples of the coordinator, the conductor and the node agent while
the overhead benchmark's load runs through Envoy (issue 24: "profile, then cut").

    python -m bench.profile [--requests 4000] [--concurrency 32] [--output docs/bench/profile.md]

The mesh is `bench.overhead`'s (4 simengines at speedup 10, `kv_affinity`, plain text between components, 16
output tokens per non-streaming request). py-spy (`py-spy record --native`, 200 samples per second) attaches to each
process after a warm-up and stops when the load ends. A sample is busy unless its innermost frame waits (epoll,
poll, futex, sleep). Per process: the busy share of the samples, then the frames that hold the most busy samples,
inclusive (a function with everything it calls) and innermost (the sample's innermost Python frame, with the native
code it called: "event loop / gRPC core" is time in the event loop's own run with no Python frame below it: uvloop,
gRPC's C core, syscalls). Envoy is C++
and not sampled: its cost per filter is `bench.overhead`'s and `docs/benchmarks.md`'s concern. py-spy slows the
processes it samples a little; the shares, not the absolute times, are the result.

py-spy attaches with ptrace: it needs root, CAP_SYS_PTRACE or `kernel.yama.ptrace_scope` 0; without, the step fails
with that message.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from bench.harness import mesh_config
from mesh.config import parse_mesh_config
from mesh.up import Mesh

#: The processes sampled; the coordinator with its children (its tokenizer worker), the agent without its engines.
PROCESSES = {"coordinator": ["--subprocesses"], "conductor": [], "agent-n1": []}
#: Innermost native frames of a sample that waits rather than works.
IDLE = (
    "epoll_wait",
    "epoll_pwait",
    "clock_nanosleep",
    "pthread_cond",
    "futex",
    "poll ",
    "select ",
    "nanosleep",
)
#: Innermost Python frames that block a thread (the native wait below them is often unsymbolized).
IDLE_PYTHON = re.compile(
    r"(^|\.)(wait|get|_recv|_recv_bytes|recv_bytes) \((threading|queue|multiprocessing/\w+)\.py\)$"
)
#: CPython blocking a thread on a lock, whatever Python frame asked (a thread pool's idle worker waits in
#: `_queue.SimpleQueue.get`, whose innermost Python frame is the worker's loop): the futex under it is often
#: unsymbolized.
IDLE_LOCK = "PyThread_acquire_lock_timed ("
#: Modules of a process's entry and event loop: in every sample, left out of the inclusive column.
ENTRY = re.compile(r"\((<frozen runpy>|mesh/__main__\.py|mesh/cli\.py|tandem/process\.py|asyncio/runners\.py|"
                   r"uvloop/__init__\.py|threading\.py|multiprocessing/(spawn|process)\.py)\)$")  # fmt: skip
#: Innermost Python frames of the event loop itself: the sample runs in the loop's own C code (uvloop, gRPC's
#: core, syscalls).
LOOP = re.compile(r"\((asyncio/runners|uvloop/__init__)\.py\)$")
EVENT_LOOP = "event loop / gRPC core (no Python frame below)"


def short(frame: str) -> str:
    """`fn (/long/path/site-packages/pkg/mod.py:12)` -> `fn (pkg/mod.py)`."""
    frame = re.sub(r":\d+\)$", ")", frame)
    return re.sub(r"\(\S*?(site-packages/|python3\.\d+/|" + re.escape(str(Path.cwd())) + r"/)", "(", frame)


def aggregate(raw: str) -> tuple[int, int, collections.Counter, collections.Counter]:
    """From py-spy's raw output (`frame;frame;... count` per line): all samples, busy samples, busy samples per
    frame (inclusive) and per innermost Python frame."""
    total = busy = 0
    inclusive: collections.Counter = collections.Counter()
    innermost: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n, frames = int(count), stack.split(";")
        total += n
        if frames[-1].startswith(IDLE) or any(f.startswith(IDLE_LOCK) for f in frames):
            continue
        python = [short(f) for f in frames if ".py" in f or "<frozen" in f]
        inner = python[-1] if python else ""
        if IDLE_PYTHON.search(inner):
            continue
        busy += n
        for f in set(python):
            if not ENTRY.search(f):
                inclusive[f] += n
        innermost[EVENT_LOOP if not inner or LOOP.search(inner) else inner] += n
    return total, busy, inclusive, innermost


def table(name: str, raw: str, top: int) -> str:
    total, busy, inclusive, innermost = aggregate(raw)
    if not busy:
        return f"**{name}**: no busy samples."
    own = inclusive.most_common(top)
    inner = innermost.most_common(top)
    lines = [
        f"**{name}**: busy in {busy} of {total} samples ({busy / total:.0%}).",
        "",
        "| inclusive | share of busy | innermost Python frame | share of busy |",
        "|---|---:|---|---:|",
    ]

    def cells(frame: str, n: int) -> tuple[str, str]:
        return (f"`{frame}`", f"{n / busy:.1%}") if frame else ("", "")

    for a, b in itertools.zip_longest(own, inner, fillvalue=("", 0)):
        lines.append("| " + " | ".join((*cells(*a), *cells(*b))) + " |")
    return "\n".join(lines)


async def load(url: str, requests: int, concurrency: int) -> int:
    """Sends `requests` non-streaming completions at `concurrency`; returns how many failed."""
    body = {"model": "tandem-sim", "prompt": "Benchmark prompt " * 20, "max_tokens": 16}
    failed = 0
    left = iter(range(requests))
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            nonlocal failed
            for _ in left:
                async with session.post(url, json=body) as resp:
                    await resp.read()
                    failed += resp.status != 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--top", type=int, default=12, help="frames per column")
    parser.add_argument("--output", help="also write the tables (markdown) to this file")
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))

    workdir = Path(tempfile.mkdtemp(prefix="tandem-profile-"))
    config = mesh_config(engines=4, engine_args=["--speedup", "10"], policy="kv_affinity")
    config["envoy"]["log_level"] = "error"
    config["security"] = {"insecure": True}  # as bench.overhead's Tandem rows
    path = workdir / "mesh.yaml"
    path.write_text(yaml.safe_dump(config))
    mesh = Mesh(parse_mesh_config(config, str(path)), str(path), workdir / "run")
    url = f"http://{config['envoy']['http_listen']}/v1/completions"
    load_before = os.getloadavg()[0]
    samplers: dict[str, subprocess.Popen] = {}
    try:
        mesh.start()
        missing = mesh.wait_for_engines(60)
        if missing:
            raise RuntimeError(f"engines not healthy: {missing}")
        asyncio.run(
            load(url, 300, args.concurrency)
        )  # warm-up: connections, caches, JIT-free but lazy imports
        pids = {c.name: c.process.pid for c in mesh.components if c.name in PROCESSES and c.process}
        for name, pid in pids.items():
            out = workdir / f"{name}.txt"
            argv_ = [py_spy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "--native",
                     "--output", str(out), *PROCESSES[name]]  # fmt: skip
            samplers[name] = subprocess.Popen(argv_, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # py-spy attached (it fails fast when it cannot)
        for name, proc in samplers.items():
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
                raise SystemExit(
                    f"py-spy could not sample {name}: {err.splitlines()[-1] if err else 'exited'} (py-spy attaches "
                    "with ptrace: root, CAP_SYS_PTRACE or kernel.yama.ptrace_scope=0)"
                )
        start = time.perf_counter()
        failed = asyncio.run(load(url, args.requests, args.concurrency))
        seconds = time.perf_counter() - start
        for proc in samplers.values():
            proc.send_signal(signal.SIGINT)
        for proc in samplers.values():
            proc.wait(60)
    finally:
        for proc in samplers.values():
            if proc.poll() is None:
                proc.kill()
        mesh.stop()
    load_after = os.getloadavg()[0]
    sections = [
        f"Profile under load: {args.requests} non-streaming requests at concurrency {args.concurrency} through "
        f"Envoy in {seconds:.1f} s ({args.requests / seconds:.0f} req/s, {failed} failed), 4 simengines at speedup "
        f"10, `kv_affinity`, plain text between components; py-spy 200 Hz with native frames. Load average (1 min) "
        f"before / after: {load_before:.2f} / {load_after:.2f}."
    ]
    for name in samplers:
        out = workdir / f"{name}.txt"
        sections.append(table(name, out.read_text() if out.exists() else "", args.top))
    text = "\n\n".join(sections)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
