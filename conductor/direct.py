"""Direct ZMQ mode: the conductor subscribes itself to engines that no node agent manages.

Per configured endpoint: a SUB socket on the engine's publisher and, on a gap, a DEALER on its replay socket.
Batches go through the same decoder (`tandem.kv_events`) and the same `IngestCore` as the agents' streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from conductor.config import DirectEndpoint
from conductor.ingest import IncomingBatch, IngestCore
from tandem.kv_events import KvEventDecodeError, decode_batch
from tandem.kv_sockets import live_batches, replay_batches

log = logging.getLogger(__name__)


class DirectSource:
    """One engine rank read directly; a source token for `IngestCore`."""

    def __init__(
        self,
        core: IngestCore,
        ep: DirectEndpoint,
        ctx: zmq.asyncio.Context,
        queue_size: int = 10_000,
        replay_timeout_s: float = 10.0,
    ) -> None:
        self.core = core
        self.ep = ep
        self.ctx = ctx
        self.replay_timeout_s = replay_timeout_s
        # bounded: when the index falls behind, batches are dropped (counted) and the gap is replayed later
        self.queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue(maxsize=queue_size)
        self.dropped = 0
        self.decode_errors = 0
        self._tasks: list[asyncio.Task] = []

    def __repr__(self) -> str:
        return f"DirectSource({self.ep.instance_id}/{self.ep.dp_rank} {self.ep.endpoint})"

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._apply())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _receive(self) -> None:
        batches = live_batches(self.ctx, self.ep.endpoint, self.ep.topic.encode())
        async with contextlib.aclosing(batches):
            async for item in batches:
                if item is None:
                    self.decode_errors += 1
                    continue
                try:
                    self.queue.put_nowait(item)
                except asyncio.QueueFull:
                    self.dropped += 1

    def _incoming(self, seq: int, payload: bytes, replayed: bool) -> IncomingBatch | None:
        try:
            batch = decode_batch(payload)
        except KvEventDecodeError:
            self.decode_errors += 1
            return None
        ep = self.ep
        return IncomingBatch(
            ep.instance_id, ep.dp_rank, seq, ep.model, ep.block_size, batch.ts, batch.events, replayed
        )

    async def _apply(self) -> None:
        can_replay = self.ep.replay_endpoint is not None
        # a (re)started conductor first rebuilds from what the engine still buffers; live batches wait in the queue
        skip_upto = await self._replay_all() if can_replay else -1
        while True:
            seq, payload = await self.queue.get()
            if seq <= skip_upto:
                continue  # already applied from the replay
            skip_upto = -1  # from here on an older sequence means an engine restart again
            b = self._incoming(seq, payload, replayed=False)
            if b is None:
                continue
            ask = self.core.batch(b, self, can_replay)
            if ask is not None:
                await self._replay(ask.from_sequence)

    async def _replay_all(self) -> int:
        """Replays from sequence 0 (the engine sends what it buffers); returns the last sequence applied."""
        last = -1
        try:
            replies = replay_batches(self.ctx, self.ep.replay_endpoint or "", 0, self.replay_timeout_s)
            async with contextlib.aclosing(replies):  # closes the DEALER even when cancelled
                async for seq, payload in replies:
                    b = self._incoming(seq, payload, replayed=True)
                    if b is not None:
                        self.core.batch(b, self, True)
                    last = seq
        except (TimeoutError, zmq.ZMQError, KvEventDecodeError) as exc:
            log.warning("initial replay failed", extra={"instance_id": self.ep.instance_id, "err": str(exc)})
        return last

    async def _replay(self, from_seq: int) -> None:
        """Replays inline; live batches wait in the bounded queue meanwhile (held by the tracker once read)."""
        ep = self.ep
        first: int | None = None
        try:
            replies = replay_batches(self.ctx, ep.replay_endpoint or "", from_seq, self.replay_timeout_s)
            async with contextlib.aclosing(replies):  # closes the DEALER even when cancelled
                async for seq, payload in replies:
                    first = seq if first is None else first
                    b = self._incoming(seq, payload, replayed=True)
                    if b is not None:
                        self.core.batch(b, self, True)
        except (TimeoutError, zmq.ZMQError, KvEventDecodeError) as exc:
            log.warning(
                "replay failed", extra={"instance_id": ep.instance_id, "dp_rank": ep.dp_rank, "err": str(exc)}
            )
            first = None
        recovered = first == from_seq
        self.core.replay_done(ep.instance_id, ep.dp_rank, recovered)
        log.info(
            "replay done",
            extra={
                "instance_id": ep.instance_id,
                "dp_rank": ep.dp_rank,
                "from": from_seq,
                "recovered": recovered,
            },
        )
