"""The P/D data path of the Mooncake connectors over the real Mooncake transfer engine (TCP transport).

The simulated KV cache is one registered host buffer: a K region and a V region of `num_blocks` blocks each
(`kv_bytes_per_block` split in two), standing for one layer. The handshake and addressing are those of
vLLM-Ascend's MooncakeConnector (vllm_ascend/distributed/mooncake_connector.py, read for facts):

- every engine initialises a `TransferEngine` with P2P handshake (`initialize(host, "P2PHANDSHAKE", "tcp", "")`)
  and registers its KV memory; its RPC port (`get_rpc_port()`) is what peers name in a session id
  `"<host>:<rpc port>"`;
- the prefill side listens on a ZMQ ROUTER at `tcp://<host>:<kv_port + dp_rank * tp_size + tp_rank>` (the
  `remote_port` its `kv_transfer_params` announce) and answers msgpack tuples:
  `("get_meta_msg", "")` -> msgpack `{engine_id, te_rpc_port, kv_caches_base_addr, num_blocks}`,
  `("done_recving_msg", request_id)` -> `b"ACK"`, after which it frees the request's held blocks;
- the decode side asks for the metadata over a REQ socket, reads every (remote block -> local block) pair of each
  region with one `batch_transfer_sync_read(session, local addrs, remote addrs, lengths)`, then always sends
  `done_recving_msg` so the prefill side frees its blocks, even after a failure;
- a failed read (negative return, unreachable peer) is logged and the request still counts as received: the
  decode goes on without recomputing, as vLLM-Ascend's connector does.

Blocking calls run in worker threads; the ROUTER has its own thread.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

log = logging.getLogger("simengine.connectors.mooncake")

GET_META_MSG = b"get_meta_msg"
DONE_RECVING_MSG = b"done_recving_msg"
#: Socket timeouts of the side channel (vLLM-Ascend uses 1 s on its REQ sockets).
_TIMEOUT_MS = 1000


def available() -> str | None:
    """None when the Mooncake transfer engine can be imported, else why not (missing wheel or libibverbs1)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return None


class AgentMetadata(msgspec.Struct, omit_defaults=True, dict=True):
    """What the prefill side tells a decode side (vLLM-Ascend's `MooncakeAgentMetadata`)."""

    engine_id: str
    #: The transfer engine's RPC (handshake) port: sessions are "<host>:<te_rpc_port>".
    te_rpc_port: int
    #: Base address of each registered region (K then V), in the prefill process.
    kv_caches_base_addr: list[int]
    num_blocks: int


@dataclass(slots=True)
class PullResult:
    """Outcome of one decode-side read."""

    ok: bool
    nbytes: int
    error: str = ""


class MooncakeTransport:
    """One engine's transfer engine, registered KV buffer and (prefill side) handshake listener."""

    def __init__(self, host: str, engine_id: str, num_blocks: int, block_bytes: int) -> None:
        from mooncake.engine import TransferEngine

        self.host = host
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        #: Bytes per block per region (K and V each hold half of `kv_bytes_per_block`).
        self.block_len = max(block_bytes // 2, 1)
        self.engine = TransferEngine()
        ret = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if ret != 0:
            raise RuntimeError(f"Mooncake transfer engine initialisation failed with {ret}")
        self.te_rpc_port = self.engine.get_rpc_port()
        region = num_blocks * self.block_len
        self._buffer = ctypes.create_string_buffer(2 * region)  # kept alive: the engine reads and writes it
        base = ctypes.addressof(self._buffer)
        if self.engine.register_memory(base, 2 * region) != 0:
            raise RuntimeError("Mooncake memory registration failed")
        self.base_addrs = [base, base + region]
        self._ctx: zmq.Context = zmq.Context.instance()
        self._router: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.port = 0

    # -- prefill side -----------------------------------------------------------------------------------------

    def listen(self, port: int, on_done: Callable[[str], object]) -> int:
        """Binds the handshake ROUTER on `host:port` (0: any free port) and serves it in a thread; `on_done` is
        called (from that thread) with each request id a decode side finished reading."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if port:
            sock.bind(f"tcp://{self.host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{self.host}")
        self._router, self.port = sock, port
        meta = msgspec.msgpack.encode(
            AgentMetadata(self.engine_id, self.te_rpc_port, list(self.base_addrs), self.num_blocks)
        )
        self._thread = threading.Thread(
            target=self._serve, args=(meta, on_done), name="mooncake-side", daemon=True
        )
        self._thread.start()
        return port

    def _serve(self, meta: bytes, on_done: Callable[[str], object]) -> None:
        sock = self._router
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        decode = msgspec.msgpack.Decoder(type=tuple).decode
        while not self._stopping.is_set():
            if not poller.poll(100):
                continue
            frames = sock.recv_multipart()
            identity, payload = frames[0], [f for f in frames[1:] if f != b""]
            try:
                msg = decode(payload[0]) if len(payload) == 1 else ()
            except msgspec.DecodeError:
                msg = ()
            if msg and msg[0] == GET_META_MSG:
                sock.send_multipart((identity, b"", meta))
            elif len(msg) == 2 and msg[0] == DONE_RECVING_MSG:
                on_done(str(msg[1]))
                sock.send_multipart((identity, b"", b"ACK"))
            else:
                log.warning("Mooncake side channel: unexpected message %r", frames[1:])
        sock.close(linger=0)

    # -- decode side ------------------------------------------------------------------------------------------

    def _request(self, host: str, port: int, message: tuple) -> bytes:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, _TIMEOUT_MS)
        sock.setsockopt(zmq.RCVTIMEO, _TIMEOUT_MS)
        try:
            sock.connect(f"tcp://{host}:{port}")
            sock.send(msgspec.msgpack.encode(message))
            return sock.recv()
        except zmq.Again:
            raise TimeoutError(f"no answer from the Mooncake side channel at {host}:{port}") from None
        finally:
            sock.close(linger=0)

    def pull(
        self, host: str, port: int, remote_request_id: str, remote_blocks: list[int], local_blocks: list[int]
    ) -> PullResult:
        """Reads the remote blocks into the local ones (blocking; run it in a thread). Always sends the done
        signal afterwards, as vLLM-Ascend does, so the prefill side frees its blocks."""
        pairs = list(zip(remote_blocks, local_blocks, strict=False))
        try:
            meta = msgspec.msgpack.decode(self._request(host, port, (GET_META_MSG, "")), type=AgentMetadata)
            if meta.engine_id == self.engine_id:
                raise ValueError(f"remote engine id {meta.engine_id} is this engine's")
            src, dst, lengths = [], [], []
            for local_base, remote_base in zip(self.base_addrs, meta.kv_caches_base_addr, strict=False):
                for remote, local in pairs:
                    src.append(local_base + local * self.block_len)
                    dst.append(remote_base + remote * self.block_len)
                    lengths.append(self.block_len)
            nbytes = sum(lengths)
            if src:
                ret = self.engine.batch_transfer_sync_read(f"{host}:{meta.te_rpc_port}", src, dst, lengths)
                if ret < 0:
                    raise RuntimeError(f"Mooncake transfer failed, ret: {ret}")
            result = PullResult(True, nbytes)
        except (OSError, RuntimeError, ValueError, TimeoutError, msgspec.DecodeError, zmq.ZMQError) as e:
            result = PullResult(False, 0, f"{type(e).__name__}: {e}")
        try:
            ack = self._request(host, port, (DONE_RECVING_MSG, remote_request_id))
            if ack != b"ACK":
                log.error("Mooncake done signal for %s got %r instead of ACK", remote_request_id, ack)
        except (TimeoutError, zmq.ZMQError) as e:
            log.error("Mooncake done signal for %s failed: %s", remote_request_id, e)
        return result

    def write_pattern(self, block: int, byte: int) -> None:
        """Fills one local block (both regions) with a byte: lets tests see real bytes cross the wire."""
        for base in self.base_addrs:
            ctypes.memset(base + block * self.block_len, byte, self.block_len)

    def read_block(self, block: int) -> bytes:
        return ctypes.string_at(self.base_addrs[0] + block * self.block_len, self.block_len)

    def close(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
