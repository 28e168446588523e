"""The suite's own safety net: processes a test leaves running are killed when it ends."""

import os
import subprocess
import sys

from tests.helpers import TEST_MARK_ENV, pid_alive, processes_marked, reap_marked


def test_a_process_the_test_started_carries_its_mark_and_is_reaped():
    mark = os.environ[TEST_MARK_ENV]  # set by the autouse fixture
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert processes_marked(mark) == [child.pid]
        assert reap_marked(mark) == [child.pid]
        child.wait(5)
        assert not pid_alive(child.pid)
    finally:
        if child.poll() is None:
            child.kill()


def test_processes_of_other_marks_are_left_alone():
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, TEST_MARK_ENV: "someone-else"},
    )
    try:
        assert reap_marked(os.environ[TEST_MARK_ENV]) == []
        assert child.poll() is None
    finally:
        child.kill()
        child.wait(5)
