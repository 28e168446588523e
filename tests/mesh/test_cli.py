"""What an operator sees at start: one-line config errors with exit code 2, the banner, the version."""

import subprocess
import sys

import pytest

from tandem.banner import banner_text
from tandem.version import __version__


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "mesh", "up"],
        ["-m", "mesh", "coordinator"],
        ["-m", "mesh", "conductor"],
        ["-m", "mesh", "agent"],
    ],
)
def test_bad_config_is_one_line_and_exit_2(tmp_path, argv):
    bad = tmp_path / "mesh.yaml"
    bad.write_text("coordinator:\n  scheduler:\n    policy: fastest\n")
    result = subprocess.run(
        [sys.executable, *argv, "--config", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "config error" in lines[0]
    assert "coordinator.scheduler: policy: unknown scheduling policy 'fastest'" in lines[0]


TWO_NODES = """
node_agents:
  - {node_id: n1, listen: 127.0.0.1:9300, engines: []}
  - {node_id: n2, listen: 127.0.0.2:9300, engines: []}
coordinator:
  topology:
    nodes:
"""


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("n3: {rack: r1}", "coordinator.topology.nodes.n3: no node agent has node_id 'n3' (known: n1, n2)"),
        ("n2: {nic: {gbytes_per_s: -25}}", "coordinator.topology.nodes.n2.nic.gbytes_per_s: Input should be"),
        ("n1: {preset: tpu}", "coordinator.topology.nodes.n1.preset: Input should be 'ascend' or 'gpu'"),
    ],
)
def test_bad_topology_entry_is_one_line_at_tandem_up(tmp_path, entry, message):
    """`tandem up` refuses a mesh file with a bad `coordinator.topology` entry before starting anything."""
    bad = tmp_path / "mesh.yaml"
    bad.write_text(TWO_NODES + f"      {entry}\n")
    result = subprocess.run(
        [sys.executable, "-m", "mesh", "up", "--config", str(bad), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "config error" in lines[0] and message in lines[0], lines
    assert not (tmp_path / "run").exists()  # nothing was started


def test_banner_has_version_and_role(monkeypatch):
    monkeypatch.delenv("TANDEM_NO_BANNER", raising=False)
    full = banner_text("coordinator", {"grpc": "127.0.0.1:9100"})
    assert __version__ in full and "coordinator" in full and "127.0.0.1:9100" in full and full.count("\n") > 3
    monkeypatch.setenv("TANDEM_NO_BANNER", "1")
    assert banner_text("coordinator", {"grpc": "127.0.0.1:9100"}) == (
        f"tandem {__version__} coordinator grpc=127.0.0.1:9100"
    )


def test_version_flag():
    out = subprocess.run([sys.executable, "-m", "mesh", "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"tandem {__version__}"
