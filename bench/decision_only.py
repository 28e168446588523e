"""Pieces for measuring a router's decision path alone.

- `null_upstream`: a do-nothing OpenAI endpoint (raw asyncio, one process, several ports) answering every request
  at once with a fixed completion, so that what a path adds is the router's own work.
- `Registrar`: keeps instances registered with a coordinator and reports them healthy (what a node agent does),
  for upstreams no agent launched (the do-nothing one).

    python -m bench.decision_only --serve-null PORT [PORT ...]     (the do-nothing upstream; used by the bench)
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import grpc

from bench.harness import TimedOut, free_ports, http_ok, wait_until
from tandem.v1 import common_pb2, registry_pb2, registry_pb2_grpc

_REPLY = (
    b'{"id":"cmpl-null","object":"text_completion","created":0,"model":"null","choices":[{"index":0,'
    b'"text":" ok","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":1,"total_tokens":2,'
    b'"completion_tokens":1}}'
)
_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(_REPLY)).encode()
    + b"\r\n\r\n"
    + _REPLY
)


class _Null(asyncio.Protocol):
    """HTTP/1.1 keep-alive: one fixed answer per request (headers, then a body of content-length bytes)."""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].lower()
            length = 0
            marker = head.find(b"content-length:")
            if marker >= 0:
                length = int(head[marker + 15 :].split(b"\r\n", 1)[0])
            if len(self.buffer) < end + 4 + length:
                return
            self.buffer = self.buffer[end + 4 + length :]
            self.transport.write(_RESPONSE)


def null_upstream(ports: list[int]) -> None:
    """Serves the do-nothing endpoint on 127.0.0.1 at `ports` until killed."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for port in ports:
            await loop.create_server(_Null, "127.0.0.1", port)
        await asyncio.Event().wait()

    import uvloop

    uvloop.run(main())


def start_null(count: int) -> tuple[subprocess.Popen, list[str]]:
    """A do-nothing upstream process on `count` free ports; returns it and the `host:port`s."""
    ports = free_ports(count)
    proc = subprocess.Popen([sys.executable, "-m", "bench.decision_only", "--serve-null", *map(str, ports)])
    addresses = [f"127.0.0.1:{p}" for p in ports]
    try:
        wait_until(lambda: http_ok(f"http://{addresses[-1]}/health"), 20, "the do-nothing upstream", 0.1)
    except TimedOut:
        proc.kill()
        raise RuntimeError("the do-nothing upstream did not start") from None
    return proc, addresses


class Registrar:
    """Registers instances with a coordinator and streams HEALTHY heartbeats for them, in a thread."""

    def __init__(self, coordinator: str, model: str, addresses: list[str], prefix: str) -> None:
        self.coordinator = coordinator
        self.instances = [
            common_pb2.Instance(
                instance_id=f"{prefix}-{i}",
                model=model,
                address=address,
                role=common_pb2.ROLE_HYBRID,
                dispatch_capability=common_pb2.DISPATCH_CAPABILITY_AGGREGATED,
                backend="simengine",
                block_size=16,
            )
            for i, address in enumerate(addresses)
        ]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with grpc.insecure_channel(self.coordinator) as channel:
                    stub = registry_pb2_grpc.RegistryStub(channel)
                    for instance in self.instances:
                        stub.Register(registry_pb2.RegisterRequest(instance=instance), timeout=2)
                    for _ in stub.Heartbeat(self._beats(), timeout=None):
                        if self._stop.is_set():
                            return
            except grpc.RpcError:
                self._stop.wait(0.5)

    def _beats(self):
        while not self._stop.is_set():
            for instance in self.instances:
                yield registry_pb2.HeartbeatRequest(
                    instance_id=instance.instance_id,
                    health=common_pb2.HEALTH_HEALTHY,
                    load=common_pb2.InstanceLoad(),
                )
            self._stop.wait(0.3)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-null"]:
        null_upstream([int(p) for p in sys.argv[2:]])
    else:
        print(__doc__)
