"""A fake vLLM KV event publisher for tests: PUB (XPUB, to know when a subscriber is there) + replay ROUTER.

Wire format from docs/wire.md: live `[topic, seq(8B BE), msgpack batch]`; replay request `["", seq]` from a DEALER,
replies `["", seq, payload]` (or `["", topic, seq, payload]`), end marker seq -1 with an empty payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

END = b"\xff" * 8


def stored(hashes, parent, tokens, block_size=4, medium="GPU", legacy=True, lora_name=None):
    """A BlockStored event in either encoding."""
    if legacy:
        return ["BlockStored", hashes, parent, tokens, block_size, None, medium, lora_name]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora_name,
    }


def removed(hashes, medium="GPU", legacy=True):
    if legacy:
        return ["BlockRemoved", hashes, medium]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def cleared(legacy=True):
    return ["AllBlocksCleared"] if legacy else {"type": "AllBlocksCleared"}


def batch(events, dp_rank=None, map_outer=False, ts=None) -> bytes:
    ts = time.time() if ts is None else ts
    if map_outer:
        return msgspec.msgpack.encode({"ts": ts, "events": events, "data_parallel_rank": dp_rank})
    return msgspec.msgpack.encode([ts, events] if dp_rank is None else [ts, events, dp_rank])


class FakeEngine:
    """Publishes batches with sequence numbers and serves replays from a bounded buffer."""

    def __init__(
        self, ctx: zmq.asyncio.Context, topic: bytes = b"", buffer: int = 1000, topic_in_replay=True
    ):
        self.ctx = ctx
        self.topic = topic
        self.topic_in_replay = topic_in_replay
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        # Every subscription reaches wait_subscriber, also one for a topic a departing subscriber still holds (a
        # restarted conductor subscribes before the old connection is torn down).
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.replay_requests: list[int] = []
        self._task = asyncio.create_task(self._serve_replay())

    async def wait_subscriber(self, timeout: float = 5.0) -> None:
        """Waits for a SUB to subscribe (XPUB hands us the subscription message, `\x01` + topic; a departed
        subscriber's `\x00` unsubscription is skipped)."""

        async def subscribed() -> None:
            while not (await self.pub.recv()).startswith(b"\x01"):
                pass

        await asyncio.wait_for(subscribed(), timeout)

    def publish(self, events, drop: bool = False, **kw) -> int:
        """Publishes one batch (or only buffers it when `drop`, to make a gap); returns its sequence."""
        seq = self.seq
        payload = batch(events, **kw)
        self.buffer.append((seq, payload))
        if not drop:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self.seq += 1
        return seq

    def forget_before(self, seq: int) -> None:
        """Drops buffered batches older than `seq` (the replay buffer wrapped)."""
        while self.buffer and self.buffer[0][0] < seq:
            self.buffer.popleft()

    async def _serve_replay(self) -> None:
        while True:
            ident, empty, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq, payload in list(self.buffer):
                if seq >= first:
                    frames = [ident, b"", seq.to_bytes(8, "big"), payload]
                    if self.topic_in_replay:
                        frames.insert(2, self.topic)
                    await self.router.send_multipart(frames)
            await self.router.send_multipart([ident, b"", END, b""])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.pub.close(0)
        self.router.close(0)
