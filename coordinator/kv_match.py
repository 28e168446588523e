"""The coordinator's client of the conductor's `Match` stream, with a deadline and a load-only fallback.

One long-lived bidirectional stream. Each request carries a deadline (now plus the timeout the coordinator waits)
and an id unique among the requests waiting; answers are paired with their request by that id, never by position,
so an answer the conductor dropped (its deadline passed before the conductor reached it) or sent late cannot be
given to another request. While the stream is down, or when an answer misses its deadline, `match` returns None at
once and the caller scores on load alone (counted in `tandem_coordinator_match_fallbacks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence

import grpc

from coordinator import metrics
from coordinator.kv_facts import NO_MATCH, KvMatch
from tandem import tracing
from tandem.chain_hash import adapter_root, chain_hashes
from tandem.tls import TlsFiles, aio_channel
from tandem.v1 import conductor_pb2, conductor_pb2_grpc

log = logging.getLogger(__name__)


def best_rank_match(hit) -> KvMatch:
    """An instance's hits as the policies see them: its best DP rank's per-medium blocks. `hit` is a
    `tandem.v1.InstanceMatch` or the conductor core's `InstanceHit` (same field names)."""
    best = next((r for r in hit.ranks if r.dp_rank == hit.best_dp_rank), None)
    if best is None:
        return NO_MATCH
    return KvMatch(best.npu_blocks, best.cpu_blocks, best.disk_blocks, hit.block_size)


class ConductorMatcher:
    """Asks the conductor which instances hold a prompt's prefix."""

    def __init__(
        self, address: str, timeout_s: float, queue_size: int = 4096, tls: TlsFiles | None = None
    ) -> None:
        self.address = address
        self.tls = tls
        self.timeout_s = timeout_s
        self._outbox: asyncio.Queue[conductor_pb2.MatchRequest] = asyncio.Queue(maxsize=queue_size)
        self._pending: dict[str, asyncio.Future] = {}  # request id on the wire -> its answer
        self._suffix = itertools.count(1)
        self._task: asyncio.Task | None = None
        self.connected = False

    def start(self) -> None:
        """Starts keeping the stream up (reconnecting with backoff)."""
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        """Stops the stream."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                async with aio_channel(self.address, self.tls, "conductor") as channel:
                    async with asyncio.timeout(5):
                        await channel.channel_ready()
                    call = conductor_pb2_grpc.ConductorStub(channel).Match(self._requests())
                    self.connected = True
                    backoff = 0.1
                    log.info("match stream open", extra={"conductor": self.address})
                    async for reply in call:
                        fut = self._pending.pop(reply.request_id, None)
                        if fut is not None and not fut.done():
                            fut.set_result(reply)
                        # An answer nobody waits for (its request timed out here) is dropped.
            except (TimeoutError, grpc.aio.AioRpcError) as exc:
                if self.connected:
                    log.warning("match stream lost", extra={"error": repr(exc)})
            self.connected = False
            pending, self._pending = self._pending, {}
            for fut in pending.values():
                if not fut.done():
                    fut.set_result(None)
            while not self._outbox.empty():
                self._outbox.get_nowait()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _requests(self):
        while True:
            yield await self._outbox.get()

    async def match(
        self,
        request_id: str,
        model: str,
        token_ids: Sequence[int],
        candidates: Sequence[str],
        block_size: int = 0,
        hashes: Sequence[int] | None = None,
        adapter: str = "",
    ) -> dict[str, KvMatch] | None:
        """Per candidate id, the best DP rank's hits; None when the conductor could not answer in time.

        With the candidates' common `block_size`, the prompt goes as its chain hashes (`tandem.chain_hash`, the
        conductor's own function; `hashes` when the caller has them already): a tenth of the bytes and no token
        conversion on the conductor's side). `adapter`: the LoRA adapter the prompt runs under (only its blocks
        count; `hashes` must then be chained from `tandem.chain_hash.adapter_root(adapter)`)."""
        if not self.connected or self._outbox.full():
            metrics.MATCH_FALLBACKS.labels("unavailable").inc()
            return None
        wire_id = request_id
        while wire_id in self._pending:  # a client reused an id still waiting: keep answers apart
            wire_id = f"{request_id}#{next(self._suffix)}"
        fut = asyncio.get_running_loop().create_future()
        self._pending[wire_id] = fut
        request = conductor_pb2.MatchRequest(
            request_id=wire_id, model=model, candidate_instance_ids=candidates, adapter=adapter
        )
        request.deadline.FromNanoseconds(int((time.time() + self.timeout_s) * 1e9))
        if tracing.ENABLED:
            request.traceparent = tracing.traceparent()
        if block_size:
            if hashes is None:
                hashes = chain_hashes(
                    token_ids, block_size, parent=adapter_root(adapter) if adapter else None
                )
            request.block_hashes.extend(hashes)
            request.block_size = block_size
        else:
            request.token_ids.extend(token_ids)
        self._outbox.put_nowait(request)
        try:
            async with asyncio.timeout(self.timeout_s):
                reply = await asyncio.shield(fut)
        except TimeoutError:
            metrics.MATCH_FALLBACKS.labels("timeout").inc()
            return None
        finally:
            if self._pending.get(wire_id) is fut:
                del self._pending[wire_id]
        if reply is None:
            metrics.MATCH_FALLBACKS.labels("unavailable").inc()
            return None
        return {
            inst.instance_id: match
            for inst in reply.instances
            if (match := best_rank_match(inst)) is not NO_MATCH
        }
