"""`tandem up`'s spare processes: a component with a spare hands over to it when its process exits, starts a new
spare only once the replacement has run a while, and leaves no spare behind when stopped."""

from __future__ import annotations

import sys
import time

import pytest

from mesh import up
from mesh.config import RestartPolicy, parse_mesh_config
from tandem.restarts import RestartTracker
from tests.helpers import pid_alive, wait_until

#: Runs until killed; with --spare, first waits for `go` on stdin and writes "went" to the log (exit 3 otherwise).
CHILD = """
import sys, time
if "--spare" in sys.argv:
    if sys.stdin.readline() != "go\\n":
        sys.exit(3)
    print("went", flush=True)
time.sleep(60)
"""


@pytest.fixture
def component(tmp_path):
    argv = [sys.executable, "-c", CHILD]
    c = up.Component(
        "c", argv, tmp_path / "c.log", RestartTracker(RestartPolicy()), spare_argv=[*argv, "--spare"]
    )
    yield c
    c.stop_spare()
    c.stop(grace=1)


def test_an_exited_process_is_replaced_by_its_waiting_spare(component):
    component.start()
    first = component.process
    assert not component.wants_spare(time.monotonic())  # just started
    assert component.wants_spare(component.started_at + up.SPARE_AFTER_S)
    component.start_spare()
    spare = component.spare
    assert spare is not None and not component.wants_spare(component.started_at + up.SPARE_AFTER_S)
    first.kill()
    first.wait()
    component.start()
    assert component.process is spare and component.spare is None
    wait_until(lambda: "went" in component.log_path.read_text(), 10, "the spare to take over")
    assert component.alive()


def test_without_a_live_spare_a_fresh_process_starts(component):
    component.start()
    component.start_spare()
    spare = component.spare
    spare.kill()
    spare.wait()
    component.process.kill()
    component.process.wait()
    component.start()
    assert component.process is not spare and component.alive()
    assert "went" not in component.log_path.read_text()


def test_a_stopped_spare_exits_without_taking_over(component):
    component.start()
    component.start_spare()
    spare = component.spare
    component.stop_spare()
    assert spare.returncode == 3 and component.spare is None  # its stdin ended: no `go`
    assert not pid_alive(spare.pid)


def test_the_mesh_says_when_a_spare_dies_and_stops_making_them(tmp_path, capsys):
    mesh = up.Mesh(
        parse_mesh_config({}, "<defaults>"), "mesh.yaml", tmp_path
    )  # supervise only: nothing started
    broken = [sys.executable, "-c", "import sys; sys.exit(5)"]
    c = up.Component("c", [sys.executable, "-c", CHILD], tmp_path / "c.log", RestartTracker(RestartPolicy()))
    c.spare_argv = broken
    mesh.components = [c]
    c.start()
    try:
        c.start_spare()
        c.spare.wait(10)
        mesh.supervise(time.monotonic())
        assert c.spare is None and c.spare_argv is None
        assert "c's spare exited (code 5)" in capsys.readouterr().err
        assert not c.wants_spare(time.monotonic() + up.SPARE_AFTER_S)
    finally:
        c.stop(grace=1)
