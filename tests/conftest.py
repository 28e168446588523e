"""Tests mirror the source tree; what they share is in `tests.helpers` (fixtures built on it are here)."""

import pytest

from conductor.config import ConductorConfig
from tests.helpers import ConductorServer


@pytest.fixture
async def conductor_server():
    """A real conductor on a free loopback port (see `tests.helpers.ConductorServer`), stopped afterwards."""
    server = ConductorServer(ConductorConfig(replay_timeout_s=30))
    await server.start()
    yield server
    await server.stop()
