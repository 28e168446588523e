"""`make bench`'s driver: a failing step fails the whole run, and every step's load average is kept."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import all as bench_all


@pytest.fixture
def steps(monkeypatch):
    def use(*steps):
        monkeypatch.setattr(bench_all, "STEPS", list(steps))
        monkeypatch.setattr(bench_all, "PLOTS", {})

    return use


def test_a_failing_step_fails_the_run_and_the_report_says_so(tmp_path, steps):
    steps(
        ("ok", "Runs", ["json.tool", "--help"], None),
        ("broken", "Fails", ["json.tool", str(tmp_path / "missing.json")], None),
    )
    assert bench_all.main(["--docs", str(tmp_path)]) == 1
    meta = json.loads((tmp_path / "bench" / "steps.json").read_text())
    assert meta["ok"]["exit"] == 0 and meta["broken"]["exit"] != 0
    assert {"load_before", "load_after"} <= set(meta["broken"])
    report = (tmp_path / "benchmarks.md").read_text()
    assert "**This step failed" in report and "## Fails" in report
    assert "missing.json" in (tmp_path / "bench" / "broken.stderr.txt").read_text()  # why, kept
    assert not (tmp_path / "bench" / "ok.stderr.txt").exists()


def test_every_step_has_its_place_in_the_run_order_and_chaos_runs_last():
    assert sorted(bench_all.RUN_ORDER) == sorted(name for name, *_ in bench_all.STEPS)
    assert bench_all.RUN_ORDER[-1] == "chaos"
    real_time = [n for n in bench_all.RUN_ORDER if n in bench_all.REAL_TIME]
    # the real-time steps but the last run before the replicas step, which the simulator's steps follow
    assert bench_all.RUN_ORDER.index("replicas") == max(bench_all.RUN_ORDER.index(n) for n in real_time[:-1])


def test_a_run_whose_steps_all_pass_succeeds(tmp_path, steps):
    steps(("ok", "Runs", ["json.tool", "--help"], None))
    assert bench_all.main(["--docs", str(tmp_path)]) == 0
    assert "| Runs |" in (tmp_path / "benchmarks.md").read_text()


def test_a_real_time_step_begun_above_the_settled_load_is_marked(tmp_path, steps, monkeypatch):
    monkeypatch.setattr(bench_all.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    monkeypatch.setattr(bench_all, "REAL_TIME", {"ok"})
    steps(("ok", "Runs", ["json.tool", "--help"], None))
    assert bench_all.main(["--docs", str(tmp_path), "--settle-s", "0"]) == 0  # no wait: it starts at 3.0
    assert "| 3.0 **(unsettled)** / 3.0 |" in (tmp_path / "benchmarks.md").read_text()


def test_settling_waits_for_the_load_average_to_fall(monkeypatch):
    loads = iter([2.0, 2.0, 1.5, 0.5])
    monkeypatch.setattr(bench_all.os, "getloadavg", lambda: (next(loads, 0.5), 0.0, 0.0))
    assert bench_all.settle(5, poll_s=0) == 0.5


BUSY_1S = [
    "timeit",
    "-n",
    "1",
    "-r",
    "1",
    "import time; t = time.process_time()\nwhile time.process_time() - t < 1: pass",
]
IDLE_1S = ["timeit", "-n", "1", "-r", "1", "import time; time.sleep(1)"]


def test_other_work_during_a_step_is_reported_apart_from_the_steps_own_cpu(tmp_path, steps):
    steps(("busy", "Busy", BUSY_1S, None))
    assert bench_all.main(["--docs", str(tmp_path)]) == 0
    own = json.loads((tmp_path / "bench" / "steps.json").read_text())["busy"]["others_cores"]
    assert own < 0.5  # a whole core of the step's own: not other work
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        steps(("idle", "Idle", IDLE_1S, None))
        assert bench_all.main(["--docs", str(tmp_path)]) == 0
    finally:
        spinner.kill()
        spinner.wait()
    meta = json.loads((tmp_path / "bench" / "steps.json").read_text())
    assert meta["idle"]["others_cores"] > 0.5  # the spinner, beside a step that sleeps
    assert f"| {meta['idle']['others_cores']} |" in (tmp_path / "benchmarks.md").read_text()
