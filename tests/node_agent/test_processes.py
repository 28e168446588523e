"""Engine processes outlive the agent: records in the state directory, adoption by pid + start time, stop."""

from __future__ import annotations

import json
import os
import signal
import sys

from node_agent.processes import (
    EngineProcess,
    ProcessRecord,
    adopt,
    env_digest,
    read_record,
    read_records,
    start_ticks,
    stop_recorded,
    write_record,
)
from tests.helpers import wait_until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def ignores_sigterm(pid: int) -> bool:
    status = open(f"/proc/{pid}/status").read()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def record_of(process: EngineProcess, name: str = "e") -> ProcessRecord:
    ticks = start_ticks(process.pid)
    assert ticks is not None
    return ProcessRecord(name, process.pid, ticks, SLEEPER, env_digest({}), 0.0, port=7000)


async def test_launched_process_reports_its_exit_code(tmp_path):
    process = EngineProcess.launch([sys.executable, "-c", "raise SystemExit(3)"], {}, str(tmp_path / "log"))
    assert not process.adopted
    assert await process.wait() == 3 and not process.running


async def test_engines_do_not_inherit_the_certificate_directory(tmp_path, monkeypatch):
    """The agent runs with TANDEM_CERTS_DIR (its key is there); an engine gets only its own launch environment."""
    monkeypatch.setenv("TANDEM_CERTS_DIR", str(tmp_path / "certs"))
    out = tmp_path / "env.json"
    dump = f"import json, os; open({str(out)!r}, 'w').write(json.dumps(dict(os.environ)))"
    process = EngineProcess.launch(
        [sys.executable, "-c", dump], {"SSL_CERT_FILE": "/run/b.pem"}, str(tmp_path / "log")
    )
    assert await process.wait() == 0
    env = json.loads(out.read_text())
    assert "TANDEM_CERTS_DIR" not in env and env["SSL_CERT_FILE"] == "/run/b.pem"
    assert not any(str(tmp_path / "certs") in value for value in env.values())


async def test_launched_process_runs_in_a_session_of_its_own(tmp_path):
    process = EngineProcess.launch(SLEEPER, {}, str(tmp_path / "log"))
    try:
        assert os.getsid(process.pid) == process.pid != os.getsid(0)
    finally:
        await process.stop(5)
    assert process.returncode == -signal.SIGTERM


async def test_record_round_trip_and_adoption(tmp_path):
    process = EngineProcess.launch(SLEEPER, {}, str(tmp_path / "log"))
    record = record_of(process)
    write_record(tmp_path / "state", record)
    assert read_record(tmp_path / "state", "e") == record and read_records(tmp_path / "state") == [record]
    assert record.same_launch(SLEEPER, {}) and not record.same_launch(SLEEPER, {"X": "1"})
    adopted = adopt(record)
    assert adopted is not None and adopted.adopted and adopted.pid == process.pid
    adopted.kill()
    assert await adopted.wait() is None  # not our child: the exit code is unknown
    assert await process.wait() == -signal.SIGKILL
    assert not record.alive() and adopt(record) is None


def test_a_reused_pid_is_not_adopted():
    # Our own pid with another start time stands for a pid reused by an unrelated process.
    record = ProcessRecord("e", os.getpid(), (start_ticks(os.getpid()) or 0) + 1, SLEEPER, "", 0.0)
    assert not record.alive() and adopt(record) is None


def test_unreadable_record_is_ignored(tmp_path):
    (tmp_path / "e.json").write_text("{not json")
    assert read_record(tmp_path, "e") is None and read_records(tmp_path) == []


async def test_stop_recorded_stops_live_processes_and_clears_records(tmp_path):
    state = tmp_path / "state"
    stubborn = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
    ]
    processes = [EngineProcess.launch(argv, {}, str(tmp_path / "log")) for argv in (SLEEPER, stubborn)]
    for i, process in enumerate(processes):
        # The child exists as soon as Popen returns.
        ticks = wait_until(lambda pid=process.pid: start_ticks(pid), 10, "the child's start time", interval=0)
        write_record(state, ProcessRecord(f"e{i}", process.pid, ticks, SLEEPER, "", 0.0))
    wait_until(lambda: ignores_sigterm(processes[1].pid), 10, "the stubborn child ignoring SIGTERM")
    write_record(state, ProcessRecord("gone", 999_999_999, 1, SLEEPER, "", 0.0))
    assert stop_recorded(state, grace_s=1.0) == ["e0", "e1"]
    assert [await p.wait() for p in processes] == [-signal.SIGTERM, -signal.SIGKILL]
    assert read_records(state) == []


def test_stop_recorded_on_a_missing_directory(tmp_path):
    assert stop_recorded(tmp_path / "none") == []
