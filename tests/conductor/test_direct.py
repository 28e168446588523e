"""Direct ZMQ mode: the conductor reads a (fake) engine's PUB socket itself and replays gaps over DEALER."""

from __future__ import annotations

import pytest
import zmq.asyncio

from conductor.app import Conductor
from conductor.config import ConductorConfig, DirectEndpoint
from conductor.match import match
from tests.conductor.fake_engine import FakeEngine, removed, stored
from tests.helpers import eventually

BS = 4
PROMPT = list(range(200, 232))


def hits(conductor):
    return {
        h.instance_id: [(r.dp_rank, r.npu_blocks, r.cpu_blocks, r.disk_blocks) for r in h.ranks]
        for h in match(conductor.index, "m", token_ids=PROMPT).instances
    }


@pytest.fixture
async def engine():
    ctx = zmq.asyncio.Context()
    eng = FakeEngine(ctx, topic=b"kv")
    yield eng
    await eng.close()
    ctx.destroy(linger=0)


async def start(engine, replay=True, dp_rank=2):
    ep = DirectEndpoint(
        instance_id="e1",
        model="m",
        block_size=BS,
        endpoint=engine.endpoint,
        replay_endpoint=engine.replay_endpoint if replay else None,
        dp_rank=dp_rank,
        topic="kv",
    )
    conductor = Conductor(ConductorConfig(direct_endpoints=[ep], replay_timeout_s=5))
    await conductor.start()
    await engine.wait_subscriber()
    return conductor


async def test_direct_live_events_and_replayed_gap(engine):
    conductor = await start(engine)
    try:
        engine.publish([stored([11, 12], None, PROMPT[:8], BS, "GPU", legacy=True)])
        engine.publish([stored([13], 12, PROMPT[8:12], BS, "GPU", legacy=False)], map_outer=True)
        await eventually(lambda: conductor.core.events_total == 2)
        assert hits(conductor) == {"e1": [(2, 3, 0, 0)]}
        # a batch the conductor never sees live, then a live one: the gap is replayed from the engine
        offload = [stored([11], None, [], BS, "cpu"), stored([14, 15], 13, PROMPT[12:20], BS, "CPU")]
        engine.publish(offload, drop=True)
        engine.publish([removed([11], "GPU", legacy=False)])
        await eventually(lambda: conductor.core.tracker.counters.recovered == 1)
        assert engine.replay_requests == [0, 2]  # the start-up rebuild, then the gap
        assert hits(conductor) == {"e1": [(2, 2, 3, 0)]}  # block 11 now counts on CPU, 14-15 too
        engine.publish([removed([11], "CPU")])
        await eventually(lambda: conductor.core.events_total == 6)
        assert hits(conductor) == {}  # the first block is gone: the walk stops at once
        s = conductor.core.stats()
        assert (s.gaps, s.replays, s.recovered, s.clears) == (1, 1, 1, 0)
    finally:
        await conductor.stop()


async def test_direct_gap_lost_from_engine_buffer_clears(engine):
    conductor = await start(engine)
    try:
        engine.publish([stored([1, 2, 3], None, PROMPT[:12], BS)])
        await eventually(lambda: conductor.core.events_total == 1)
        engine.publish([removed([3])], drop=True)
        engine.forget_before(2)  # the engine's replay buffer no longer has seq 1
        engine.publish([stored([9], None, PROMPT[:4], BS, "STORAGE")])
        await eventually(lambda: conductor.core.tracker.counters.clears == 1)
        assert hits(conductor) == {"e1": [(2, 0, 0, 1)]}
    finally:
        await conductor.stop()


async def test_direct_without_replay_socket_clears_on_gap(engine):
    conductor = await start(engine, replay=False, dp_rank=0)
    try:
        engine.publish([stored([1, 2], None, PROMPT[:8], BS)])
        await eventually(lambda: conductor.core.events_total == 1)
        engine.publish([], drop=True)
        engine.publish([stored([5], None, PROMPT[:4], BS)])
        await eventually(lambda: conductor.core.tracker.counters.clears == 1)
        assert hits(conductor) == {"e1": [(0, 1, 0, 0)]}
        assert engine.replay_requests == []
    finally:
        await conductor.stop()


async def test_restarted_conductor_rebuilds_direct_sources_from_replay(engine):
    conductor = await start(engine)
    engine.publish([stored([1, 2], None, PROMPT[:8], BS)])
    engine.publish([stored([3], 2, PROMPT[8:12], BS, "CPU")])
    await eventually(lambda: conductor.core.events_total == 2)
    await conductor.stop()
    engine.publish([removed([3], "CPU")])  # while no conductor listens
    conductor = await start(engine)  # a new, empty conductor
    try:
        await eventually(lambda: conductor.core.events_total == 3)
        assert hits(conductor) == {"e1": [(2, 2, 0, 0)]}
        engine.publish([stored([3], 2, PROMPT[8:12], BS, "STORAGE")])  # live again, in order
        await eventually(lambda: conductor.core.events_total == 4)
        assert hits(conductor) == {"e1": [(2, 2, 0, 1)]}
        s = conductor.core.stats()
        assert (s.gaps, s.clears, s.restarts) == (0, 0, 0)
    finally:
        await conductor.stop()
