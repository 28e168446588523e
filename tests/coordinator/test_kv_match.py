"""The coordinator's Match client against a real conductor on loopback, and its fallback when there is none."""

from __future__ import annotations

import asyncio
import time

from conductor.app import SERVICE_NAME
from coordinator import metrics
from coordinator.kv_match import ConductorMatcher
from coordinator.scheduling import KvMatch
from tandem.grpc_server import GrpcApp
from tandem.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from tests.helpers import block_stored, eventually, free_port, ingest_batch

BS = 4
PROMPT = list(range(500, 532))  # 8 blocks


def fallbacks(reason: str) -> float:
    return metrics.MATCH_FALLBACKS.labels(reason)._value.get()


async def ingest(server, *requests) -> None:
    """Feeds `requests` on one Ingest stream and waits until the index shows their blocks."""

    async def feed():
        for r in requests:
            yield r

    async for _ in server.stub.Ingest(feed()):
        pass
    await server.wait_stats(lambda s: s.events_total == sum(len(r.batch.events) for r in requests))


async def test_match_reports_per_medium_hits_of_the_best_rank(conductor_server):
    hashes = list(range(1, 9))
    await ingest(
        conductor_server,
        ingest_batch("i0", 1, [block_stored(hashes[:5], None, PROMPT[: 5 * BS])]),
        ingest_batch(
            "i0", 2, [block_stored(hashes[5:7], 5, PROMPT[5 * BS : 7 * BS], medium=common_pb2.MEDIUM_CPU)]
        ),
        ingest_batch("i1", 1, [block_stored(hashes[:2], None, PROMPT[: 2 * BS])]),
    )
    matcher = ConductorMatcher(conductor_server.address, timeout_s=2.0)
    matcher.start()
    await eventually(lambda: matcher.connected, 5, "the Match stream")
    hits = await matcher.match("r1", "m", PROMPT, ["i0", "i1", "i2"])
    by_hashes = await matcher.match("r2", "m", PROMPT, ["i0", "i1", "i2"], block_size=BS)
    await matcher.close()
    assert by_hashes == hits  # chain hashes computed here, or tokens hashed by the conductor: same answer
    assert hits["i1"] == KvMatch(2, 0, 0, BS)
    assert hits["i0"] == KvMatch(5, 2, 0, BS)
    assert "i2" not in hits


async def test_conductor_down_falls_back_at_once_and_counts():
    matcher = ConductorMatcher(f"127.0.0.1:{free_port()}", timeout_s=2.0)
    matcher.start()
    before = fallbacks("unavailable")
    assert await asyncio.wait_for(matcher.match("r", "m", [1, 2, 3], ["i0"]), 0.5) is None
    assert fallbacks("unavailable") == before + 1
    await matcher.close()


class ReversingConductor(conductor_pb2_grpc.ConductorServicer):
    """Answers Match requests two at a time, in reverse order, each naming its first candidate."""

    def __init__(self) -> None:
        self.seen: list[conductor_pb2.MatchRequest] = []

    async def Match(self, request_iterator, context):
        held = []
        async for req in request_iterator:
            self.seen.append(req)
            held.append(req)
            if len(held) == 2:
                for r in reversed(held):
                    yield conductor_pb2.MatchResponse(
                        request_id=r.request_id,
                        instances=[
                            conductor_pb2.InstanceMatch(
                                instance_id=r.candidate_instance_ids[0],
                                block_size=BS,
                                best_dp_rank=0,
                                ranks=[conductor_pb2.RankMatch(dp_rank=0, npu_blocks=1)],
                            )
                        ],
                    )
                held = []


async def test_answers_are_paired_by_request_id_not_by_position():
    fake = ReversingConductor()
    app = GrpcApp("fake-conductor", listen="127.0.0.1:0")
    app.add_service(SERVICE_NAME, conductor_pb2_grpc.add_ConductorServicer_to_server, fake)
    await app.start()
    matcher = ConductorMatcher(f"127.0.0.1:{app.bound_port}", timeout_s=5.0)
    matcher.start()
    try:
        await eventually(lambda: matcher.connected, 5, "the Match stream")
        first = asyncio.create_task(matcher.match("a", "m", PROMPT, ["i-a"]))
        # A client reusing a request id still waiting gets a distinct id on the wire.
        second = asyncio.create_task(matcher.match("a", "m", PROMPT, ["i-b"]))
        a, b = await asyncio.gather(first, second)
        assert list(a) == ["i-a"] and list(b) == ["i-b"]
        assert len({r.request_id for r in fake.seen}) == 2
        # Every request carries the deadline the matcher itself waits for.
        assert all(r.HasField("deadline") for r in fake.seen)
    finally:
        await matcher.close()
        await app.server.stop(0)


async def test_conductor_drops_requests_past_their_deadline(conductor_server):
    await ingest(conductor_server, ingest_batch("i0", 1, [block_stored([1, 2], None, PROMPT[: 2 * BS])]))
    expired = conductor_pb2.MatchRequest(request_id="late", model="m", token_ids=PROMPT)
    expired.deadline.FromSeconds(1)  # long past
    fresh = conductor_pb2.MatchRequest(request_id="fresh", model="m", token_ids=PROMPT)
    fresh.deadline.FromNanoseconds(int((time.time() + 30) * 1e9))
    open_ended = conductor_pb2.MatchRequest(request_id="none", model="m", token_ids=PROMPT)

    async def feed():
        for r in (expired, fresh, open_ended):
            yield r

    answered = [reply.request_id async for reply in conductor_server.stub.Match(feed())]
    assert answered == ["fresh", "none"]
    assert conductor_server.conductor.service.expired_matches == 1


async def test_match_for_an_adapter_counts_only_that_adapters_blocks(conductor_server):
    base, lora = (
        block_stored([11, 12], None, PROMPT[: 2 * BS]),
        block_stored([21, 22, 23], None, PROMPT[: 3 * BS]),
    )
    lora.block_stored.lora_name = "sql"
    await ingest(conductor_server, ingest_batch("base", 1, [base]), ingest_batch("sql", 1, [lora]))
    matcher = ConductorMatcher(conductor_server.address, timeout_s=2.0)
    matcher.start()
    await eventually(lambda: matcher.connected, 5, "the Match stream")
    ids = ["base", "sql"]
    plain = await matcher.match("r1", "m", PROMPT, ids, block_size=BS)
    sql = await matcher.match("r2", "m", PROMPT, ids, block_size=BS, adapter="sql")
    by_tokens = await matcher.match("r3", "m", PROMPT, ids, adapter="sql")
    other = await matcher.match("r4", "m", PROMPT, ids, block_size=BS, adapter="chat")
    await matcher.close()
    assert plain == {"base": KvMatch(2, 0, 0, BS)}
    assert sql == by_tokens == {"sql": KvMatch(3, 0, 0, BS)}
    assert other == {}
