"""The systemd unit verifies, and the agent speaks sd_notify: READY=1 once serving, WATCHDOG=1 periodically."""

from __future__ import annotations

import configparser
import os
import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from node_agent.processes import read_records
from node_agent.systemd import SystemdNotify
from tests.helpers import ROOT, free_ports, wait_until

UNIT = ROOT / "deploy" / "systemd" / "tandem-agent.service"


def unit_options() -> dict[str, str]:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(UNIT)
    return {k: v for section in parser.sections() for k, v in parser[section].items()}


def test_unit_declares_notify_restart_hardening_and_etc_tandem():
    opts = unit_options()
    assert opts["Type"] == "notify" and opts["NotifyAccess"] == "main" and opts["WatchdogSec"] == "30"
    assert opts["Restart"] == "on-failure"
    assert "--config /etc/tandem/mesh.yaml" in opts["ExecStart"]
    assert opts["EnvironmentFile"] == "-/etc/tandem/agent.env"
    for key in (
        "NoNewPrivileges",
        "ProtectKernelTunables",
        "RestrictSUIDSGID",
        "PrivateTmp",
        "LockPersonality",
    ):
        assert opts[key] == "yes", key
    assert opts["ProtectSystem"] == "strict" and opts["CapabilityBoundingSet"] == ""
    assert "PrivateDevices" not in opts  # engines need the accelerators
    # Engines outlive the agent: a stop or restart signals the agent only and keeps their sockets and records.
    assert opts["KillMode"] == "process" and opts["RuntimeDirectoryPreserve"] == "yes"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_passes(tmp_path):
    # verify checks that ExecStart exists: point it at an executable that does, keep everything else.
    text = UNIT.read_text().replace("/opt/tandem/venv/bin/tandem", sys.executable)
    unit = tmp_path / "tandem-agent.service"
    unit.write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "tandem-agent.service" not in result.stderr, result.stderr


def test_notify_is_silent_outside_systemd():
    notify = SystemdNotify({})
    notify.ready("x")
    assert not notify.enabled and notify.sent == [] and notify.watchdog_interval_s is None
    assert (
        SystemdNotify({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "4000000"}).watchdog_interval_s
        == 2.0
    )
    other = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}
    assert SystemdNotify(other).watchdog_interval_s is None  # the watchdog is another process's


def test_agent_sends_ready_then_watchdog(tmp_path):
    sock_path = str(tmp_path / "notify.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(sock_path)
    server.settimeout(30)
    ports = free_ports(5)
    mesh = {
        "security": {"insecure": True},  # systemd notifications only: no coordinator or conductor runs
        "coordinator": {"listen": f"127.0.0.1:{ports[0]}"},
        "conductor": {"listen": f"127.0.0.1:{ports[1]}"},
        "node_agents": [
            {
                "node_id": "n1",
                "listen": f"127.0.0.1:{ports[2]}",
                "metrics_listen": f"127.0.0.1:{ports[3]}",
                "runtime_dir": str(tmp_path / "rt"),
                "engines": [{"instance_id": "s", "model": "m", "port": ports[4], "kv_events": False}],
            }
        ],
    }
    config = tmp_path / "mesh.yaml"
    config.write_text(yaml.safe_dump(mesh))
    env = {**os.environ, "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "300000", "TANDEM_NO_BANNER": "1"}
    env.pop("WATCHDOG_PID", None)
    agent = subprocess.Popen(
        [sys.executable, "-m", "mesh", "agent", "--config", str(config)], env=env, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        messages = []

        def two_watchdog_pings() -> bool:
            messages.append(server.recv(4096).decode())
            return messages.count("WATCHDOG=1") >= 2

        wait_until(two_watchdog_pings, 30, "READY then two watchdog pings", interval=0)
        assert messages[0].startswith("READY=1\nSTATUS=serving 127.0.0.1:")
        assert messages[1:3] == ["WATCHDOG=1", "WATCHDOG=1"]
        agent.terminate()  # systemctl stop/restart: the agent exits, its engine keeps serving
        assert agent.wait(30) == 0
        assert server.recv(4096).decode() == "STOPPING=1"
        (record,) = read_records(tmp_path / "rt" / "state")
        assert record.name == "s" and record.alive()
    finally:
        if agent.poll() is None:
            agent.kill()
        server.close()
        stop = subprocess.run(
            [sys.executable, "-m", "mesh", "agent", "stop", "--engines", "--config", str(config)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert stop.returncode == 0 and stop.stdout.strip() == "agent n1: not running; stopped s", stop.stderr
    assert not record.alive() and read_records(tmp_path / "rt" / "state") == []
