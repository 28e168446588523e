"""The node agent's KV event relay against a fake engine (ZMQ PUB + replay ROUTER) and a real conductor."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import zmq.asyncio

from conductor.config import ConductorConfig
from conductor.match import match
from node_agent.kv_relay import KvEventRelay
from tandem.kv_events import EventBatch
from tandem.kv_wire import batch_to_pb
from tests.conductor.fake_engine import FakeEngine, removed, stored  # one copy of the wire format
from tests.helpers import ConductorServer, eventually

BS = 4
PROMPT = list(range(300, 332))


def hits(server: ConductorServer):
    res = match(server.conductor.index, "m", token_ids=PROMPT)
    return {
        h.instance_id: [(r.dp_rank, r.npu_blocks, r.cpu_blocks, r.disk_blocks) for r in h.ranks]
        for h in res.instances
    }


@pytest.fixture
async def env():
    ctx = zmq.asyncio.Context()
    engine = FakeEngine(ctx, topic=b"")
    server = ConductorServer(ConductorConfig(replay_timeout_s=10))
    await server.start()
    relay = KvEventRelay(server.address, "node-1", backoff_initial_s=0.05, backoff_max_s=0.3)
    relay.add_source("inst-1", "m", BS, 1, engine.endpoint, engine.replay_endpoint)
    task = asyncio.create_task(relay.run())
    await engine.wait_subscriber()
    await eventually(relay.connected.is_set)
    yield engine, server, relay
    await relay.close()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    with contextlib.suppress(Exception):
        await server.stop()
    await engine.close()
    ctx.destroy(linger=0)


def events(server):
    return server.conductor.core.events_total


async def test_relays_live_events_of_both_encodings_then_instance_gone(env):
    engine, server, relay = env
    await eventually(lambda: engine.replay_requests == [0])  # the replay every new stream starts with
    engine.publish([stored([1, 2], None, PROMPT[:8], BS, "GPU", legacy=True)], dp_rank=1)
    engine.publish([stored([3], 2, PROMPT[8:12], BS, "cpu", legacy=False)], map_outer=True)
    await eventually(lambda: events(server) == 2)
    assert hits(server) == {"inst-1": [(1, 2, 1, 0)]}
    relay.remove_source("inst-1")
    await eventually(lambda: not server.conductor.index.holders)
    assert hits(server) == {}


async def test_gap_is_replayed_through_the_agent(env):
    engine, server, relay = env
    await eventually(lambda: engine.replay_requests == [0])
    engine.publish([stored([1, 2], None, PROMPT[:8], BS)])
    await eventually(lambda: events(server) == 1)
    engine.publish([stored([3, 4], 2, PROMPT[8:16], BS, "STORAGE")], drop=True)  # lost on the way
    engine.publish([removed([1])])
    await eventually(lambda: server.conductor.core.tracker.counters.recovered == 1)
    assert engine.replay_requests == [0, 1]
    engine.publish([stored([1], None, PROMPT[:4], BS, "CPU")])
    await eventually(lambda: events(server) == 4)
    assert hits(server) == {"inst-1": [(1, 1, 1, 2)]}
    assert server.conductor.core.tracker.counters.clears == 0


async def test_unrecoverable_gap_clears_the_rank(env):
    engine, server, relay = env
    await eventually(lambda: engine.replay_requests == [0])
    engine.publish([stored([1, 2], None, PROMPT[:8], BS)])
    await eventually(lambda: events(server) == 1)
    engine.publish([removed([2])], drop=True)
    engine.forget_before(2)
    engine.publish([stored([7], None, PROMPT[:4], BS, "cpu")])
    await eventually(lambda: server.conductor.core.tracker.counters.clears == 1)
    await eventually(lambda: events(server) >= 2)
    assert hits(server) == {"inst-1": [(1, 0, 1, 0)]}


@pytest.mark.parametrize("published_while_down", [True, False])
async def test_restarted_conductor_rebuilds_from_replay(env, published_while_down):
    # With the engine quiet while the conductor is down, the dead stream's writer must not outlive it: one left
    # waiting for the queue took the new stream's first replayed batch and lost it.
    engine, server, relay = env
    await eventually(lambda: engine.replay_requests == [0])
    engine.publish([stored([1, 2], None, PROMPT[:8], BS)])
    engine.publish([stored([3, 4], 2, PROMPT[8:16], BS, "CPU")])
    await eventually(lambda: events(server) == 2)
    await server.stop()  # the conductor dies; the engine keeps running
    await eventually(lambda: not relay.connected.is_set())
    if published_while_down:
        engine.publish([removed([4], "CPU")])
    await server.start()  # a new, empty conductor on the same port
    await eventually(lambda: relay.connects == 2)
    await eventually(lambda: events(server) == 2 + published_while_down)
    assert hits(server) == {"inst-1": [(1, 2, 1 if published_while_down else 2, 0)]}
    assert engine.replay_requests[-1] == 0
    engine.publish([stored([5], None, PROMPT[:4], BS, "STORAGE")])  # live events flow again
    await eventually(lambda: events(server) == 3 + published_while_down)
    assert server.conductor.core.tracker.counters.gaps == 0


async def test_a_burst_waits_in_zmq_rather_than_being_dropped_and_replayed():
    ctx = zmq.asyncio.Context()
    engine = FakeEngine(ctx, topic=b"")
    server = ConductorServer(ConductorConfig(replay_timeout_s=10))
    await server.start()
    relay = KvEventRelay(server.address, "node-1", queue_size=2)  # a burst of 300 cannot fit
    relay.add_source("inst-1", "m", BS, 0, engine.endpoint, engine.replay_endpoint)
    task = asyncio.create_task(relay.run())
    try:
        await engine.wait_subscriber()
        # The stream's first replay must be over: while it runs, live batches are held (at most queue_size) and
        # the overflow is a gap to replay, which is not what this test is about.
        await eventually(
            lambda: (
                engine.replay_requests == [0]
                and relay.connected.is_set()
                and not any(s.holding for s in relay.sources.values())
            )
        )
        for i in range(300):
            engine.publish([stored([1000 + i], None, [i, i, i, i], BS)])
        await eventually(lambda: events(server) == 300)
        assert (relay.dropped, server.conductor.core.tracker.counters.gaps, engine.replay_requests) == (
            0,
            0,
            [0],
        )
        assert relay.batches_sent == 300
    finally:
        await relay.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop()
        await engine.close()
        ctx.destroy(linger=0)


def batch(seq: int):
    return batch_to_pb(EventBatch(0.0, []), "inst-1", 0, seq, "m", BS, False)


async def test_queued_batches_travel_together_and_keep_their_order_with_control_messages():
    relay = KvEventRelay("127.0.0.1:1", "node-x")  # nothing is sent: the stream's messages are read here
    relay._send(batch(0))
    relay._send(batch(1))
    relay.remove_source("gone")  # InstanceGone, queued between the batches
    relay._send(batch(2))
    messages = relay._requests()
    first, second, third = [await anext(messages) for _ in range(3)]
    assert [b.sequence for b in first.batches.batches] == [0, 1]
    assert second.instance_gone.instance_id == "gone"
    assert [b.sequence for b in third.batches.batches] == [2]
    assert (relay.messages_sent, relay.batches_sent) == (2, 3)
    await messages.aclose()
    await relay.close()


@pytest.mark.parametrize("linger_s", [0.0, 1.0])
async def test_a_batch_alone_waits_the_linger_for_the_next_ones_to_join_its_message(linger_s):
    relay = KvEventRelay("127.0.0.1:1", "node-x", coalesce_linger_s=linger_s)
    relay._send(batch(0))
    messages = relay._requests()
    first = asyncio.ensure_future(anext(messages))
    await eventually(relay._out.empty)  # batch 0 taken, nothing behind it
    relay._send(batch(1))  # within the linger (if any)
    sent = [await asyncio.wait_for(first, 10)]
    if linger_s == 0:  # no linger: batch 0 left alone, batch 1 follows in a message of its own
        sent.append(await asyncio.wait_for(anext(messages), 10))
    assert [[b.sequence for b in m.batches.batches] for m in sent] == ([[0, 1]] if linger_s else [[0], [1]])
    await messages.aclose()
    await relay.close()


async def test_queue_is_bounded_and_drops_are_counted():
    relay = KvEventRelay("127.0.0.1:1", "node-x", queue_size=2)
    for i in range(5):
        relay.remove_source(f"gone-{i}")  # nothing drains the queue: the conductor is unreachable
    assert relay.dropped == 3
    await relay.close()


async def test_source_added_late_gets_what_it_published_before_subscribing(env):
    engine, server, relay = env
    ctx = zmq.asyncio.Context()
    late = FakeEngine(ctx)
    try:
        late.publish([stored([1, 2], None, PROMPT[:8], BS)])  # nobody subscribed yet: lost live
        late.publish([stored([3], 2, PROMPT[8:12], BS, "CPU")])
        relay.add_source("inst-2", "m", BS, 0, late.endpoint, late.replay_endpoint)
        await late.wait_subscriber()
        await eventually(lambda: hits(server).get("inst-2") == [(0, 2, 1, 0)])
        late.publish([removed([3], "CPU")])
        await eventually(lambda: hits(server).get("inst-2") == [(0, 2, 0, 0)])
        assert late.replay_requests == [0]
    finally:
        await late.close()
        ctx.destroy(linger=0)


async def test_malformed_batch_is_skipped_and_the_rank_cleared(env):
    engine, server, relay = env
    await eventually(lambda: engine.replay_requests == [0])
    engine.publish([stored([1, 2], None, PROMPT[:8], BS)])
    engine.publish([stored([3], 2, [2**40] * BS, BS)])  # a token id that is no uint32
    engine.publish([stored([5], None, PROMPT[:4], BS, "CPU")])
    await eventually(lambda: server.conductor.core.tracker.counters.clears == 1)
    await eventually(lambda: hits(server) == {"inst-1": [(1, 0, 1, 0)]})
    assert relay.decode_errors >= 1
