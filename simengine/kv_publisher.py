"""Publishes KV events on ZMQ exactly as vLLM's `ZmqEventPublisher` does (vllm/distributed/kv_events.py).

- PUB socket; binds when the endpoint has `*` or `::` or is `ipc://` / `inproc://`, connects otherwise.
- Per DP rank, tcp ports are offset by the rank and inproc names get `_dp<rank>`. vLLM raises ValueError for an
  ipc endpoint at rank > 0; the simulator (one process per rank) uses the ipc path as given, so a launcher that
  names one ipc path per process (as Tandem's node agent does) works.
- Live message: 3 frames (topic, 8-byte big-endian sequence, msgpack batch `[ts, [events], dp_rank]`).
- Events are maps tagged `"type"` with defaulted fields omitted (current vLLM), or tagged positional arrays
  with the legacy flag (vLLM <= 0.23 style).
- Replay: a ROUTER socket; a DEALER sends `["", start_seq]`; it gets `["", topic, seq, payload]` per buffered
  batch from `start_seq` on, then the end marker `["", "", -1, ""]` (legacy: without the topic frame).

All sockets live in one thread (ZMQ sockets are not thread-safe); the engine hands it encoded batches through an
inproc PAIR socket, so publishing costs the event loop one encode and one non-blocking send.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from simengine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("simengine.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_pair_ids = itertools.count()


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` keys."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    #: The simulator binds loopback by default instead of vLLM's `tcp://*:5557` (nothing binds 0.0.0.0 unasked).
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    #: Accepted (newer vLLM): offload events carry token ids. The simulator's events always do.
    self_describing_kv_events: bool = False

    @classmethod
    def from_json(cls, raw: dict) -> KVEventsConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}")
        cfg = cls(**raw)
        if cfg.enable_kv_cache_events and raw.get("publisher") is None:
            cfg.publisher = "zmq"
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: unknown publisher {cfg.publisher!r}")
        return cfg

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """The endpoint of DP rank `dp_rank` (vLLM's `offset_endpoint_port`; ipc paths are kept as given)."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    if endpoint.startswith("ipc://"):
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + dp_rank}"
    raise ValueError(f"invalid KV events endpoint {endpoint!r}: expected tcp://, ipc:// or inproc://")


def should_bind(endpoint: str) -> bool:
    """vLLM's heuristic: bind stable endpoints (wildcards, ipc, inproc), connect to explicit hosts."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _event_map(ev: KVEvent) -> dict:
    """vLLM's msgspec encoding: tag first, fields in declaration order, defaulted (None) trailing fields
    omitted; `parent_block_hash`, `lora_id`, `medium` and `lora_name` have no default, so they are always there."""
    if isinstance(ev, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": ev.block_hashes,
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": ev.token_ids,
            "block_size": ev.block_size,
            "lora_id": ev.lora_id,
            "medium": ev.medium,
            "lora_name": ev.lora_name,
        }
        if ev.extra_keys is not None:
            out["extra_keys"] = ev.extra_keys
        if ev.group_idx is not None:
            out["group_idx"] = ev.group_idx
        if ev.kv_cache_spec_kind is not None:
            out["kv_cache_spec_kind"] = ev.kv_cache_spec_kind
        return out
    if isinstance(ev, BlockRemoved):
        removed: dict[str, Any] = {
            "type": "BlockRemoved",
            "block_hashes": ev.block_hashes,
            "medium": ev.medium,
        }
        if ev.group_idx is not None:
            removed["group_idx"] = ev.group_idx
        return removed
    return {"type": "AllBlocksCleared"}


def _event_array(ev: KVEvent) -> list:
    if isinstance(ev, BlockStored):
        return [
            "BlockStored",
            ev.block_hashes,
            ev.parent_block_hash,
            ev.token_ids,
            ev.block_size,
            ev.lora_id,
            ev.medium,
            ev.lora_name,
        ]
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", ev.block_hashes, ev.medium]
    assert isinstance(ev, AllBlocksCleared)
    return ["AllBlocksCleared"]


class ZmqEventPublisher:
    """PUB + ROUTER replay in a background thread, fed by `publish()` from the event loop."""

    def __init__(
        self,
        config: KVEventsConfig,
        dp_rank: int = 0,
        legacy_format: bool = False,
        gap_every: int = 0,
    ) -> None:
        self.dp_rank = dp_rank
        self.legacy = legacy_format
        self.gap_every = gap_every
        self.endpoint = offset_endpoint(config.endpoint, dp_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, dp_rank)
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(config.buffer_steps, 1))
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._pair_addr = f"inproc://simengine-kv-{id(self)}-{next(_pair_ids)}"
        self._in = self._ctx.socket(zmq.PAIR)
        self._in.bind(self._pair_addr)
        self._out = self._ctx.socket(zmq.PAIR)
        self._out.set_hwm(config.max_queue_size)
        self._out.connect(self._pair_addr)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if not self.endpoint:
            raise ValueError("kv_events.endpoint: required when KV events are enabled")
        if should_bind(self.endpoint):
            self._pub.bind(self.endpoint)
        else:
            self._pub.connect(self.endpoint)
        self._replay: zmq.Socket | None = None
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)
        self._seq = 0
        self._batches = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Encodes one batch (`[ts, [events], dp_rank]`) and queues it; called on the event loop."""
        enc = _event_array if self.legacy else _event_map
        payload = self._encoder.encode([time.time(), [enc(e) for e in events], self.dp_rank])
        try:
            self._out.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV event queue full, dropping a batch")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._in in ready:
                payload = self._in.recv()
                if payload == b"":
                    break
                self._send(payload)
            if self._replay is not None and self._replay in ready:
                self._serve_replay()
        for sock in (self._pub, self._replay, self._in):
            if sock is not None:
                sock.close(linger=0)

    def _send(self, payload: bytes) -> None:
        seq = self._seq
        self._seq += 1
        self._batches += 1
        if self.gap_every and self._batches % self.gap_every == 0:
            return  # fault injection: this sequence number is never sent nor replayable
        seq_bytes = seq.to_bytes(8, "big")
        self._pub.send_multipart((self._topic, seq_bytes, payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None  # polled only when bound
        frames = replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid replay request with %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                if self.legacy:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                else:
                    replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        if self.legacy:
            replay.send_multipart((client, b"", END_SEQ, b""))
        else:
            replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def shutdown(self) -> None:
        try:
            self._out.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        self._thread.join(timeout=1.0)
        self._out.close(linger=0)
