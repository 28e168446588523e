"""KV events on ZMQ, decoded by a subscriber written from docs/wire.md alone (not from simengine's code)."""

import msgspec
import zmq

from tests.helpers import TimedOut, free_port, wait_until

END = (-1).to_bytes(8, "big", signed=True)


def decode_batch(payload: bytes):
    """docs/wire.md: batch = [ts, [events], dp_rank] (or a map at the outer level); events are maps tagged "type"
    (current) or arrays with the tag first (legacy). Returns (dp_rank, [normalised event dicts])."""
    batch = msgspec.msgpack.decode(payload)
    if isinstance(batch, dict):
        ts, events, dp = batch["ts"], batch["events"], batch.get("data_parallel_rank")
    else:
        ts, events, dp = batch[0], batch[1], batch[2] if len(batch) > 2 else None
    assert isinstance(ts, float)
    out = []
    for ev in events:
        if isinstance(ev, dict):
            out.append(ev)
        elif ev[0] == "BlockStored":
            keys = [
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
            ]
            out.append({"type": "BlockStored", **dict(zip(keys, ev[1:], strict=False))})
        elif ev[0] == "BlockRemoved":
            out.append(
                {"type": "BlockRemoved", **dict(zip(["block_hashes", "medium"], ev[1:], strict=False))}
            )
        else:
            out.append({"type": ev[0]})
    return dp, out


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes = b"", bind: bool = False):
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        if bind:
            self.sub.bind(endpoint)
        else:
            self.sub.connect(endpoint)
        self.seqs: list[int] = []
        self.events: list[dict] = []
        self.ranks: set = set()

    def poll(self, until, timeout=5.0) -> bool:
        """Receives batches until `until(events)` holds; False when it does not within `timeout` seconds."""

        def received() -> bool:
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                dp, evs = decode_batch(payload)
                self.ranks.add(dp)
                self.events.extend(evs)
            return until(self.events)

        try:
            return bool(wait_until(received, timeout, interval=0))
        except TimedOut:
            return False

    def join(self, engine, timeout=10.0):
        """Waits out ZMQ's slow joiner (a new SUB misses what is published before its subscription reaches the
        PUB, or before a connecting PUB joins): posts throwaway prompts until their events arrive; returns those
        events and forgets them."""
        probes = iter(range(1000))

        def received() -> bool:
            n = next(probes)
            engine.post(
                "/v1/completions", {"prompt": [2000 + 40 * n + k for k in range(40)], "max_tokens": 1}
            )
            return self.poll(bool, timeout=0.5)

        wait_until(received, timeout, "the subscription to reach the engine", interval=0)
        events = list(self.events)
        self.seqs.clear()
        self.events.clear()
        self.ranks.clear()
        return events

    def close(self):
        self.sub.close(linger=0)


def replay(endpoint: str, start: int):
    """docs/wire.md: DEALER sends ["", seq]; replies ["", (topic,) seq, payload]; end marker seq -1, empty payload."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    try:
        while sock.poll(3000):
            frames = sock.recv_multipart()
            assert frames[0] == b""
            seq, payload = frames[-2], frames[-1]
            if seq == END:
                assert payload == b""
                return got, len(frames)
            got.append((int.from_bytes(seq, "big"), decode_batch(payload)))
        raise AssertionError("no end marker")
    finally:
        sock.close(linger=0)


def kv_config(tmp_path, name="e", replay_ep=True, topic="kv"):
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp_path}/{name}.pub",
           "topic": topic}  # fmt: skip
    if replay_ep:
        cfg["replay_endpoint"] = f"ipc://{tmp_path}/{name}.replay"
    return cfg


def test_events_replay_and_end_marker(engines, tmp_path):
    cfg = kv_config(tmp_path)
    e = engines(
        "--speedup", "1000", "--kv-events-config", msgspec.json.encode(cfg).decode(), "--block-size", "16"
    )
    sub = Subscriber(cfg["endpoint"])
    sub.join(e)
    prompt = list(range(300, 340))
    e.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert sub.poll(lambda evs: any(x["type"] == "BlockStored" for x in evs))
    stored = [x for x in sub.events if x["type"] == "BlockStored"][0]
    assert stored["medium"] == "GPU" and stored["block_size"] == 16 and stored["parent_block_hash"] is None
    assert stored["token_ids"] == prompt[:32] and len(stored["block_hashes"]) == 2
    assert all(isinstance(h, int) for h in stored["block_hashes"])
    assert {"lora_id", "lora_name"} <= set(stored) and sub.ranks == {0}
    assert stored["group_idx"] == 0 and stored["kv_cache_spec_kind"] == "full_attention"
    assert stored["extra_keys"] == [None, None]
    # replay from 0: as vLLM, the first batch (seq 0) is the first cache change, no reset marker before it
    batches, nframes = replay(cfg["replay_endpoint"], 0)
    assert nframes == 4  # current framing: ["", topic, seq, payload]; end ["", "", -1, ""]
    assert batches[0][0] == 0 and batches[0][1][1][0]["type"] == "BlockStored"
    assert [s for s, _ in batches] == list(range(len(batches)))
    later, _ = replay(cfg["replay_endpoint"], 1)
    assert later == batches[1:]
    sub.close()


def test_eviction_and_offload_media(engines, tmp_path):
    cfg = kv_config(tmp_path, replay_ep=False)
    e = engines("--speedup", "1000", "--kv-events-config", msgspec.json.encode(cfg).decode(), "--block-size", "16",
                "--npu-blocks", "8", "--cpu-blocks", "4", "--disk-blocks", "16", "--offload")  # fmt: skip
    sub = Subscriber(cfg["endpoint"])
    sub.join(e)
    for i in range(4):
        e.post("/v1/completions", {"prompt": [100 + i * 50 + k for k in range(64)], "max_tokens": 1})

    def seen(evs, kind, medium):
        return any(x["type"] == kind and x["medium"] == medium for x in evs)

    assert sub.poll(lambda evs: seen(evs, "BlockStored", "STORAGE"))
    assert seen(sub.events, "BlockRemoved", "GPU") and seen(sub.events, "BlockStored", "CPU")
    assert seen(sub.events, "BlockRemoved", "CPU")
    removed = {
        h
        for x in sub.events
        if x["type"] == "BlockRemoved" and x["medium"] == "GPU"
        for h in x["block_hashes"]
    }
    cpu = {
        h
        for x in sub.events
        if x["type"] == "BlockStored" and x["medium"] == "CPU"
        for h in x["block_hashes"]
    }
    assert cpu <= removed  # what reached the CPU tier was evicted from the NPU first
    # a lower-tier hit is a prefix-cache hit
    before = e.metric("vllm:prefix_cache_hits_total")
    e.post("/v1/completions", {"prompt": [100 + k for k in range(64)], "max_tokens": 1})
    assert e.metric("vllm:prefix_cache_hits_total") > before
    sub.close()


def test_legacy_format_and_dp_rank_offset(engines, tmp_path):
    cfg = kv_config(tmp_path, name="legacy")
    e = engines("--speedup", "1000", "--kv-events-config", msgspec.json.encode(cfg).decode(),
                "--kv-events-legacy-format", "--data-parallel-rank", "2")  # fmt: skip
    pub, rep = cfg["endpoint"], cfg["replay_endpoint"]  # ipc paths are used as given (one process per rank)
    sub = Subscriber(pub)
    sub.join(e)
    e.post("/v1/completions", {"prompt": list(range(300, 340)), "max_tokens": 1})
    assert sub.poll(lambda evs: any(x["type"] == "BlockStored" for x in evs))
    raw = msgspec.msgpack.decode(replay_raw(rep))
    assert raw[1][0][0] == "BlockStored" and raw[2] == 2
    batches, nframes = replay(rep, 0)
    assert nframes == 3 and sub.ranks == {2}  # legacy framing: ["", seq, payload]
    sub.close()


def replay_raw(endpoint: str) -> bytes:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    assert sock.poll(3000)
    frames = sock.recv_multipart()
    sock.close(linger=0)
    return frames[-1]


def test_event_gap_fault(engines, tmp_path):
    cfg = kv_config(tmp_path, name="gap")
    e = engines("--speedup", "1000", "--kv-events-config", msgspec.json.encode(cfg).decode(),
                "--fault-event-gap-every", "2")  # fmt: skip
    for i in range(3):
        e.post("/v1/completions", {"prompt": [200 + i * 40 + k for k in range(40)], "max_tokens": 1})
    batches, _ = replay(cfg["replay_endpoint"], 0)
    seqs = [s for s, _ in batches]
    assert seqs[0] == 0 and 1 not in seqs and len(seqs) >= 2  # every second sequence number is missing


def test_explicit_tcp_host_connects_to_a_binding_subscriber(engines):
    """vLLM's heuristic: an explicit host means connect (the subscriber binds); `*`, `::`, ipc bind."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Subscriber(endpoint, bind=True)
    cfg = {"enable_kv_cache_events": True, "endpoint": endpoint}
    e = engines("--speedup", "1000", "--kv-events-config", msgspec.json.encode(cfg).decode())
    assert "BlockStored" in {ev["type"] for ev in sub.join(e)}
    sub.close()
