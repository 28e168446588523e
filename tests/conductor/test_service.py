"""The Conductor gRPC service end to end on loopback: Ingest, Match over the stream, GetIndexStats; the process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conductor.app import SERVICE_NAME, Conductor
from conductor.config import ConductorConfig
from conductor.metrics import register
from mesh.certs import ensure_certs
from mesh.config import parse_mesh_config
from tandem.tls import TlsFiles, aio_channel
from tandem.v1 import common_pb2, conductor_pb2, conductor_pb2_grpc
from tests.helpers import block_stored, free_ports, ingest_batch

PROMPT = list(range(500, 532))  # 8 blocks of 4 tokens


async def test_ingest_match_stats_end_to_end(conductor_server):
    stub, wait_stats = conductor_server.stub, conductor_server.wait_stats
    health = await health_pb2_grpc.HealthStub(conductor_server.channel).Check(
        health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING

    ingest = stub.Ingest()
    await ingest.write(ingest_batch("a", 0, [block_stored([1, 2, 3, 4], None, PROMPT[:16])]))
    await ingest.write(
        ingest_batch(
            "a",
            1,
            [block_stored([1, 2], None, [], common_pb2.MEDIUM_CPU), block_stored([5, 6], 4, PROMPT[16:24])],
        )
    )
    await ingest.write(
        ingest_batch("b", 7, [block_stored([9, 8], None, PROMPT[:8], common_pb2.MEDIUM_DISK)], rank=1)
    )
    s = await wait_stats(lambda s: s.events_total == 4)
    assert (s.instances, s.npu_blocks, s.cpu_blocks, s.disk_blocks) == (2, 6, 2, 2)

    match = stub.Match()
    await match.write(conductor_pb2.MatchRequest(request_id="r1", model="m", token_ids=PROMPT))
    await match.write(
        conductor_pb2.MatchRequest(request_id="r2", model="m", token_ids=PROMPT, candidate_instance_ids=["b"])
    )
    await match.write(conductor_pb2.MatchRequest(request_id="r3", model="nope", token_ids=PROMPT))
    r1, r2, r3 = [await match.read() for _ in range(3)]
    assert r1.request_id == "r1"
    assert [(i.instance_id, i.matched_tokens, i.best_dp_rank) for i in r1.instances] == [
        ("a", 24, 0),
        ("b", 8, 1),
    ]
    a = r1.instances[0].ranks[0]
    assert (a.npu_blocks, a.cpu_blocks, a.disk_blocks, a.matched_tokens) == (6, 0, 0, 24)
    b = r1.instances[1].ranks[0]
    assert (b.dp_rank, b.npu_blocks, b.cpu_blocks, b.disk_blocks) == (1, 0, 0, 2)
    assert [i.instance_id for i in r2.instances] == ["b"]
    assert r3.request_id == "r3" and not r3.instances

    # a gap on a: the conductor asks this agent stream for a replay; the agent cannot recover it
    await ingest.write(ingest_batch("a", 3, [block_stored([77], None, PROMPT[:4])]))
    reply = await asyncio.wait_for(ingest.read(), 5)
    assert reply.replay == conductor_pb2.ReplayRequest(instance_id="a", dp_rank=0, from_sequence=2)
    await ingest.write(
        conductor_pb2.IngestRequest(replay_done=conductor_pb2.ReplayDone(instance_id="a", recovered=False))
    )
    s = await wait_stats(lambda s: s.clears == 1)
    assert (s.gaps, s.replays, s.npu_blocks) == (1, 1, 1)  # cleared, then the held live batch applied

    await ingest.write(conductor_pb2.IngestRequest(instance_gone=conductor_pb2.InstanceGone(instance_id="b")))
    await wait_stats(lambda s: s.instances == 1)
    await match.write(
        conductor_pb2.MatchRequest(request_id="r4", model="m", block_hashes=[], token_ids=PROMPT)
    )
    r4 = await match.read()
    assert [(i.instance_id, i.matched_tokens) for i in r4.instances] == [("a", 4)]
    await match.done_writing()
    await ingest.done_writing()


async def test_agent_stream_ending_mid_replay_clears_that_rank(conductor_server):
    stub = conductor_server.stub
    ingest = stub.Ingest()
    bad = ingest_batch("z", 0, [block_stored([1], None, PROMPT[:4])])
    bad.batch.block_size = 0  # rejected, counted, the stream carries on
    await ingest.write(bad)
    await ingest.write(ingest_batch("a", 0, [block_stored([1, 2], None, PROMPT[:8])]))
    await ingest.write(ingest_batch("a", 5, []))
    assert (await ingest.read()).replay.from_sequence == 1
    await ingest.done_writing()
    s = await conductor_server.wait_stats(lambda s: s.clears == 1)
    assert s.npu_blocks == 0 and s.instances == 0
    assert conductor_server.conductor.service.rejected_batches == 1


async def test_coalesced_batches_apply_in_order_as_if_sent_one_by_one(conductor_server):
    ingest = conductor_server.stub.Ingest()
    rejected = ingest_batch("z", 0, [block_stored([1], None, PROMPT[:4])]).batch
    rejected.block_size = 0
    batches = [
        ingest_batch("a", 0, [block_stored([1, 2], None, PROMPT[:8])]).batch,
        rejected,  # counted and skipped; the batches after it still apply
        ingest_batch("a", 1, [block_stored([3], 2, PROMPT[8:12])]).batch,
        ingest_batch(
            "a", 3, [block_stored([9], None, PROMPT[:4], common_pb2.MEDIUM_CPU)]
        ).batch,  # 2 is missing
    ]
    await ingest.write(conductor_pb2.IngestRequest(batches=conductor_pb2.KvEventBatches(batches=batches)))
    reply = await ingest.read()
    assert reply.replay == conductor_pb2.ReplayRequest(instance_id="a", dp_rank=0, from_sequence=2)
    s = await conductor_server.wait_stats(lambda s: s.events_total == 2)
    assert (s.npu_blocks, s.cpu_blocks, s.gaps) == (3, 0, 1)  # the batch after the gap waits for the replay
    assert conductor_server.conductor.service.rejected_batches == 1
    await ingest.done_writing()


def test_metrics_collector_exposes_figures():
    from prometheus_client import CollectorRegistry, generate_latest

    conductor = Conductor(ConductorConfig())
    registry = CollectorRegistry()
    register(conductor.core, conductor.extra_counters, registry)
    text = generate_latest(registry).decode()
    assert 'tandem_conductor_blocks{medium="npu"} 0.0' in text
    assert "tandem_conductor_gaps_total 0.0" in text and "tandem_conductor_matches_total 0.0" in text


def test_bad_configuration_exits_with_one_line(tmp_path):
    cfg = tmp_path / "mesh.yaml"
    cfg.write_text("conductor:\n  listen: 0.0.0.0:9200\n")
    out = subprocess.run(
        [sys.executable, "-m", "mesh", "conductor", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2
    assert "config error" in out.stderr and "conductor: listen: '0.0.0.0:9200'" in out.stderr
    assert "replica_addresses" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    cfg.write_text("conductor:\n  max_entriez: 5\n")
    out = subprocess.run(
        [sys.executable, "-m", "mesh", "conductor", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "max_entriez" in out.stderr


async def test_process_serves_and_stops_on_sigterm(tmp_path):
    port, mport = free_ports(2)
    ensure_certs(tmp_path, parse_mesh_config({}))
    env = {**os.environ, "TANDEM_NO_BANNER": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "mesh", "conductor", "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{mport}",
        "--certs-dir", str(tmp_path), env=env, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        operator = TlsFiles.for_role(tmp_path, "operator")
        async with aio_channel(f"127.0.0.1:{port}", operator, "conductor") as channel:
            stub = conductor_pb2_grpc.ConductorStub(channel)
            stats = await stub.GetIndexStats(
                conductor_pb2.GetIndexStatsRequest(), wait_for_ready=True, timeout=20
            )
            assert stats.instances == 0
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_config_rejects_duplicate_direct_endpoints_and_unknown_keys():
    import pydantic

    ep = {"instance_id": "e", "model": "m", "block_size": 16, "endpoint": "tcp://127.0.0.1:5557"}
    with pytest.raises(pydantic.ValidationError, match="listed twice"):
        ConductorConfig(direct_endpoints=[ep, ep])
    with pytest.raises(pydantic.ValidationError):
        ConductorConfig(direct_endpoints=[{**ep, "port": 1}])
    assert ConductorConfig(direct_endpoints=[ep, {**ep, "dp_rank": 1}]).direct_endpoints[1].dp_rank == 1
