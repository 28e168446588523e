"""KV events and `InstanceGone` only from the owning node's agent (`conductor.event_owners`, applied by
`ConductorService`), and the per-holder bound of the index: a compromised node's agent certificate cannot erase
or skew another node's entries, nor fill the index with invented blocks."""

from __future__ import annotations

from conductor.app import Conductor
from conductor.config import ConductorConfig
from conductor.event_owners import EventOwners
from conductor.index import KvIndex
from conductor.service import AgentStream
from tandem.kv_events import BlockStored, Medium
from tandem.v1 import conductor_pb2
from tests.helpers import block_stored, ingest_batch

NAMED = {"a-0": frozenset({"n1"}), "b-0": frozenset({"n2"})}


def test_named_ids_belong_to_their_node_and_others_to_the_first_sender():
    owners = EventOwners(NAMED, direct=["z-0"], max_per_node=3)
    assert owners.problem("n1", "a-0") is None
    assert "gives instance 'a-0' to node n1" in owners.problem("n2", "a-0")
    assert "conductor.direct_endpoints" in owners.problem("n1", "z-0")
    assert owners.problem("n2", "free-0") is None
    assert "node 'n2'" in owners.problem("n1", "free-0")
    owners.gone("n2", "free-0")  # released by its owner
    assert owners.problem("n1", "free-0") is None
    assert owners.node_lost("n1") == ["free-0"]  # its streams ended: released too
    assert owners.problem("n2", "free-0") is None


def test_a_node_speaks_for_a_bounded_number_of_engine_ranks():
    """Ids and DP ranks are both the agent's word: inventing ranks of one id counts as much as inventing ids."""
    owners = EventOwners({}, max_per_node=3)
    assert [owners.problem("n1", "x-0", rank) for rank in range(3)] == [None] * 3
    assert "at most 3" in owners.problem("n1", "x-0", 3)
    assert "at most 3" in owners.problem("n1", "x-1", 0)
    assert owners.problem("n1", "x-0", 1) is None  # one it already has
    assert owners.problem("n2", "y-0", 0) is None  # another node's cap is its own
    owners.gone("n1", "x-0")
    assert owners.problem("n1", "x-1", 0) is None


def test_one_holder_cannot_take_the_whole_index():
    """The issue's 1.5M fake hashes from one holder: it keeps at most `max_per_holder` (its newest); another
    holder's blocks are untouched and the drops are counted."""
    index = KvIndex(max_entries=10_000, max_per_holder=100)
    victim = index.holder("a-0", 0, "m", 1)
    index.store(victim, BlockStored([1, 2], None, [5, 6], 1, Medium.NPU))
    flood = index.holder("rogue-0", 0, "m", 1)
    for i in range(50):  # 1,000 invented chained blocks in 50 events
        parent = None if i == 0 else 10_000 + i * 20 - 1
        hashes = list(range(10_000 + i * 20, 10_000 + (i + 1) * 20))
        index.store(flood, BlockStored(hashes, parent, list(range(i * 20, (i + 1) * 20)), 1, Medium.NPU))
    assert len(flood.blocks) == 100 and next(iter(flood.blocks)) == 10_900  # its newest kept
    assert len(victim.blocks) == 2 and index.entries == 102
    assert index.counters.holder_cap_evicted == 900


async def read(conductor: Conductor, node: str | None, messages) -> None:
    async def source():
        for m in messages:
            yield m

    await conductor.service._read(source(), AgentStream("test", 8, node))  # noqa: SLF001 - the stream's reader


async def test_another_nodes_agent_cannot_erase_or_fill_an_instances_entries():
    """Node n2's agent sends `InstanceGone` and KV events for n1's instance: both are dropped and counted; n1's
    own events are indexed; without TLS (no node) nothing is checked."""
    conductor = Conductor(ConductorConfig(), NAMED)
    events = [block_stored([1], None, [1, 2, 3, 4])]
    await read(conductor, "n1", [ingest_batch("a-0", 1, events)])
    assert conductor.index.entries == 1
    gone = conductor_pb2.IngestRequest(instance_gone=conductor_pb2.InstanceGone(instance_id="a-0"))
    forged = [gone, ingest_batch("a-0", 2, [block_stored([9], None, [9, 9, 9, 9])])]
    await read(conductor, "n2", forged)
    assert conductor.index.entries == 1 and conductor.service.foreign_messages == 2
    assert conductor.extra_counters()["foreign_messages"] == 2
    await read(conductor, "n1", [gone])  # the owner may
    assert conductor.index.entries == 0
    await read(conductor, None, [ingest_batch("a-0", 1, events)])  # insecure mode: no identity, no check
    assert conductor.index.entries == 1


async def test_a_rank_keeps_at_most_the_blocks_its_engine_reports():
    """The reported capacity (`KvEventBatch.capacity_blocks`) bounds a holder below `max_blocks_per_holder`."""
    conductor = Conductor(ConductorConfig(max_blocks_per_holder=100))
    batch = ingest_batch("a-0", 1, [block_stored(list(range(1, 21)), None, list(range(80)))])
    batch.batch.capacity_blocks = 8
    await read(conductor, None, [batch])
    assert conductor.index.entries == 8 and conductor.extra_counters()["holder_cap_evicted_entries"] == 12
