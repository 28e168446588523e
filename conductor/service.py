"""`tandem.v1.Conductor` over grpc.aio: a thin shell over `IngestCore` and `match`."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from conductor.config import ConductorConfig
from conductor.convert import batch_from_pb, match_to_pb, stats_to_pb
from conductor.event_owners import EventOwners
from conductor.ingest import IngestCore
from conductor.match import match
from tandem import tracing
from tandem.tls import agent_node, caller_var
from tandem.v1 import conductor_pb2, conductor_pb2_grpc

log = logging.getLogger(__name__)


class AgentStream:
    """One node agent's `Ingest` stream: a source token for `IngestCore` and its bounded replay-request queue."""

    def __init__(self, peer: str, size: int, node: str | None = None) -> None:
        self.peer = peer
        self.node = node  # the caller's node (its certificate), None without TLS
        self.warned = False  # a refused message was logged (once per stream)
        self.replies: asyncio.Queue[conductor_pb2.IngestResponse] = asyncio.Queue(maxsize=size)
        self.dropped = 0

    def __repr__(self) -> str:
        return f"AgentStream({self.peer})"


class ConductorService(conductor_pb2_grpc.ConductorServicer):
    """Ingest from node agents (with TLS, each only about its own node's instances: `conductor.event_owners`),
    Match for the coordinator, GetIndexStats for operators."""

    def __init__(self, core: IngestCore, config: ConductorConfig, owners: EventOwners | None = None) -> None:
        self.core = core
        self.config = config
        self.owners = owners or EventOwners(
            direct=(ep.instance_id for ep in config.direct_endpoints),
            max_per_node=config.max_ranks_per_node,
        )
        self.streams: set[AgentStream] = set()
        self.foreign_messages = 0  # Ingest messages about instances of another node (or over the node's cap)
        self.rejected_batches = 0
        self.matches = 0
        self.truncated_matches = 0
        self.expired_matches = 0  # Match requests dropped because their deadline had passed
        self.dropped_replays = 0

    async def Ingest(self, request_iterator, context: grpc.aio.ServicerContext):
        stream = AgentStream(context.peer(), self.config.replay_queue_size, agent_node(caller_var.get()))
        self.streams.add(stream)
        reader = asyncio.create_task(self._read(request_iterator, stream))
        log.info("agent connected", extra={"peer": stream.peer})
        try:
            while True:
                get = asyncio.ensure_future(stream.replies.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    yield get.result()
                    continue
                get.cancel()
                while not stream.replies.empty():  # replay requests decided on the last messages
                    yield stream.replies.get_nowait()
                break
            reader.result()
        finally:
            reader.cancel()
            self.streams.discard(stream)
            self.core.source_lost(stream)
            if stream.node is not None and not any(s.node == stream.node for s in self.streams):
                self.owners.node_lost(stream.node)
            log.info("agent disconnected", extra={"peer": stream.peer})

    def _foreign(self, stream: AgentStream, instance_id: str, dp_rank: int | None = None) -> bool:
        """True (counted, logged once per stream) when the stream's node may not speak for `instance_id`."""
        if stream.node is None:
            return False
        problem = self.owners.problem(stream.node, instance_id, dp_rank)
        if problem is None:
            return False
        self.foreign_messages += 1
        if not stream.warned:
            stream.warned = True
            log.warning(
                "ingest message refused", extra={"peer": stream.peer, "node": stream.node, "error": problem}
            )
        return True

    def _batch(self, b: conductor_pb2.KvEventBatch, stream: AgentStream) -> None:
        """One engine batch into the index; a gap queues a replay request for the stream's agent."""
        if not b.instance_id or b.block_size == 0 or not b.model:
            self.rejected_batches += 1
            return
        if self._foreign(stream, b.instance_id, b.dp_rank):
            return
        ask = self.core.batch(batch_from_pb(b), stream, can_replay=True)
        if ask is None:
            return
        msg = conductor_pb2.IngestResponse(
            replay=conductor_pb2.ReplayRequest(
                instance_id=ask.instance_id, dp_rank=ask.dp_rank, from_sequence=ask.from_sequence
            )
        )
        try:
            stream.replies.put_nowait(msg)
        except asyncio.QueueFull:  # the rank's replay times out and is cleared
            self.dropped_replays += 1

    async def _read(self, request_iterator, stream: AgentStream) -> None:
        core = self.core
        async for req in request_iterator:
            kind = req.WhichOneof("message")
            if kind == "batches":
                for b in req.batches.batches:
                    self._batch(b, stream)
            elif kind == "batch":
                self._batch(req.batch, stream)
            elif kind == "replay_done":
                d = req.replay_done
                if not self._foreign(stream, d.instance_id, d.dp_rank):
                    core.replay_done(d.instance_id, d.dp_rank, d.recovered)
            elif kind == "instance_gone":
                iid = req.instance_gone.instance_id
                if not self._foreign(stream, iid):
                    core.instance_gone(iid)
                    if stream.node is not None:
                        self.owners.gone(stream.node, iid)

    async def Match(self, request_iterator, context: grpc.aio.ServicerContext):
        budget = self.config.match_deadline_ms / 1000.0
        async for req in request_iterator:
            deadline = time.perf_counter() + budget
            if req.HasField("deadline"):
                left = req.deadline.ToNanoseconds() / 1e9 - time.time()
                if left <= 0:
                    # The coordinator has stopped waiting: answering would only delay the requests behind it.
                    self.expired_matches += 1
                    continue
                deadline = min(deadline, time.perf_counter() + left)
            if tracing.ENABLED and req.traceparent:
                parent = tracing.context_of({tracing.TRACEPARENT: req.traceparent})
                with tracing.span("conductor.match", parent, {"tandem.model": req.model}) as current:
                    result = self._match(req, deadline)
                    tracing.set_attributes(
                        current,
                        {
                            "tandem.blocks": len(req.block_hashes)
                            or len(req.token_ids) // max(1, req.block_size),
                            "tandem.instances_hit": len(result.instances),
                            "tandem.truncated": result.truncated,
                        },
                    )
            else:
                result = self._match(req, deadline)
            self.matches += 1
            if result.truncated:
                self.truncated_matches += 1
            yield match_to_pb(req.request_id, result)

    def _match(self, req: conductor_pb2.MatchRequest, deadline: float):
        return match(
            self.core.index,
            req.model,
            token_ids=req.token_ids,
            block_hashes=req.block_hashes,
            block_size=req.block_size,
            candidates=req.candidate_instance_ids,
            deadline=deadline,
            adapter=req.adapter,
        )

    async def GetIndexStats(self, request, context: grpc.aio.ServicerContext):
        return stats_to_pb(self.core.stats())
