"""Tests mirror the source tree; what they share is in `tests.helpers` (fixtures built on it are here)."""

import shutil
import uuid

import pytest

from conductor.config import ConductorConfig
from tests.helpers import TEST_MARK_ENV, ConductorServer, Etcd, reap_marked


@pytest.fixture(autouse=True)
def _reap_leftover_processes(monkeypatch):
    """Marks every process the test starts (through the environment they inherit) and kills those still running
    when it ends, passed or failed: engines outlive their agent by design, so a test that fails half-way would
    otherwise leave them serving and disturb the tests after it."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(TEST_MARK_ENV, mark)
    yield
    leftover = reap_marked(mark)
    if leftover:
        print(f"killed {len(leftover)} process(es) the test left running: {leftover}")


@pytest.fixture
async def conductor_server():
    """A real conductor on a free loopback port (see `tests.helpers.ConductorServer`), stopped afterwards."""
    server = ConductorServer(ConductorConfig(replay_timeout_s=30))
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def etcd(tmp_path):
    """A real etcd member on free loopback ports (see `tests.helpers.Etcd`), stopped afterwards; skips where Debian's
    `etcd-server` and `etcd-client` are not installed."""
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        pytest.skip("etcd not installed (apt-get install -y etcd-server etcd-client)")
    server = Etcd(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()
