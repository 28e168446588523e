"""Client side of an engine's KV event sockets (vLLM's ZMQ publisher and replay ROUTER), shared by the node
agent's relay and the conductor's direct mode. The wire itself is decoded by `tandem.kv_events`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator

import zmq
import zmq.asyncio

from tandem.kv_events import KvEventDecodeError, encode_seq, split_message, split_replay_reply

END = -1  # sequence of the replay end marker
BURST = 64  # live messages read in one go when the engine published faster than they were read


async def live_batches(
    ctx: zmq.asyncio.Context, endpoint: str, topic: bytes = b""
) -> AsyncGenerator[tuple[int, bytes] | None]:
    """`(seq, payload)` of every batch the engine publishes (SUB, connected); None for a message that does not
    decode, so that the caller can count it. Runs until cancelled; the socket closes with the generator."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    now: zmq.Socket = zmq.Socket.shadow(sub.underlying)  # the same socket, read without a future per message
    try:
        while True:
            burst = [await sub.recv_multipart()]
            # What else is queued, up to a bound (the loop's other tasks run between bursts), costs no loop pass.
            with contextlib.suppress(zmq.Again):
                while len(burst) < BURST:
                    burst.append(now.recv_multipart(zmq.NOBLOCK))
            for frames in burst:
                try:
                    _, seq, payload = split_message(frames)
                except KvEventDecodeError:
                    yield None
                    continue
                yield seq, payload
    finally:
        sub.close(0)


async def replay_batches(
    ctx: zmq.asyncio.Context, endpoint: str, from_seq: int, timeout_s: float
) -> AsyncGenerator[tuple[int, bytes]]:
    """`(seq, payload)` of an engine's replay socket from `from_seq` on, until its end marker (DEALER framing:
    send `["", seq]`, replies `["", seq, payload]` or `["", topic, seq, payload]`).

    Raises TimeoutError when the engine stays silent for `timeout_s`.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", encode_seq(from_seq)])
        while True:
            if not await sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"replay socket {endpoint} silent for {timeout_s}s")
            seq, payload = split_replay_reply(await sock.recv_multipart())
            if seq == END:
                return
            yield seq, payload
    finally:
        sock.close(0)
