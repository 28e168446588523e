"""Tests mirror the source tree; what they share is in `tests.helpers` (fixtures built on it are here)."""

import shutil

import pytest

from conductor.config import ConductorConfig
from tests.helpers import ConductorServer, Etcd


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
