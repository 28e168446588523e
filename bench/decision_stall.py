"""Does one huge prompt stall the decisions of the small ones? The coordinator's decision path alone (its
ext_proc service over gRPC, no Envoy, no engines), with small requests at a fixed concurrency and a huge prompt
arriving now and then, parsed and tokenized inline on the event loop, on a thread pool (what the interpreter lock
allows), or in a worker process (`coordinator.decision_inline_bytes`, `decision_processes`), side by side in
one run.

    python -m bench.decision_stall [--small 2000] [--concurrency 16] [--huge-kb 1024] [--huge-every 100]

Each variant runs in its own coordinator process (started here, on a free port); the load generator is this
process. Printed: latency of the small decisions (p50, p99, max) and of the huge ones, and the coordinator's CPU
seconds per 1,000 decisions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from bench.harness import TimedOut, free_ports, wait_until
from bench.overhead import cpu_seconds
from bench.replay import percentile

#: name -> (inline_bytes, pool kind)
VARIANTS = {
    "inline (every body on the event loop)": (1 << 40, ""),
    "thread pool above 8 KiB": (8192, "thread"),
    "worker process above 8 KiB (the default)": (8192, "process"),
}


class ThreadUnderstand:
    """The same interface as UnderstandPool, on 2 threads of the coordinator's process (for comparison)."""

    def __init__(self, picker) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.picker = picker
        self.pool = ThreadPoolExecutor(2)

    async def understand(self, api, raw_body, known_models, max_model_len=None, adapters=None):
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, self.picker.understand, api, raw_body
        )


def serve(port: int, inline_bytes: int, kind: str) -> None:
    """A coordinator decision service with 4 registered instances (run in a child process)."""
    from coordinator.attempts import AttemptRegistry
    from coordinator.config import CoordinatorConfig
    from coordinator.decision import Decider
    from coordinator.ext_proc import ExternalProcessor
    from coordinator.handoff import HandoffRunner
    from coordinator.instances import InstanceInfo, InstanceTable
    from coordinator.picker import EndpointPicker
    from coordinator.tickets import TicketTable
    from coordinator.trigger import TriggerCoordinator
    from coordinator.understanding import TokenizerCache
    from coordinator.workload import WorkloadLedger
    from tandem.tokenizer import load_tokenizer

    async def main() -> None:
        table = InstanceTable(["m"])
        for i in range(4):
            table.register(InstanceInfo(f"i{i}", "m", f"127.0.0.1:{8100 + i}", "hybrid", "aggregated"))
        config = CoordinatorConfig(scheduler={"policy": "least_load"})
        ledger = WorkloadLedger()
        picker = EndpointPicker(
            config, table, ledger, config.scheduler.build(), TokenizerCache({}, load_tokenizer)
        )
        runner = HandoffRunner(picker, 5.0, 1)
        trigger = TriggerCoordinator(runner, AttemptRegistry(), "http://127.0.0.1:1/v1/metaserver/c0")
        # Tickets end at once here (no Envoy, no access log): a short lifetime keeps the ledger small.
        pool = None
        if kind == "process":
            from coordinator.understand_pool import UnderstandPool

            pool = UnderstandPool(1, {}, config)
            await pool.start()
        elif kind == "thread":
            pool = ThreadUnderstand(picker)
        decider = Decider(picker, runner, trigger, TicketTable(ledger, 0.5), pool, inline_bytes)

        async def expire() -> None:
            while True:
                await asyncio.sleep(0.5)
                decider.tickets.expire()

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(decider, 10.0), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        task = asyncio.create_task(expire())
        await stop.wait()
        task.cancel()
        await server.stop(1)
        if kind == "process":
            pool.close()

    import uvloop

    uvloop.run(main())


def _message(body: bytes) -> ep.ProcessingRequest:
    attributes = struct_pb2.Struct()
    attributes.update({"request.path": "/v1/completions", "request.method": "POST", "request.id": "b"})
    return ep.ProcessingRequest(
        request_body=ep.HttpBody(body=body, end_of_stream=True),
        attributes={"envoy.filters.http.ext_proc": attributes},
    )


async def _decide(stub, message: ep.ProcessingRequest) -> float:
    start = time.perf_counter()
    call = stub.Process()
    await call.write(message)
    reply = await call.read()
    await call.done_writing()
    assert reply.HasField("request_body"), reply
    return time.perf_counter() - start


async def load(port: int, args) -> tuple[list[float], list[float]]:
    small_body = json.dumps({"model": "m", "prompt": "a short question about Envoy " * 8}).encode()
    words = "The quick brown fox jumps over the lazy dog and keeps running. "
    huge_body = json.dumps({"model": "m", "prompt": words * (args.huge_kb * 1024 // len(words))}).encode()
    small, huge = _message(small_body), _message(huge_body)
    small_lat: list[float] = []
    huge_lat: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        for _ in range(50):  # warm up
            await _decide(stub, small)
        counter = iter(range(args.small))
        huge_tasks: list[asyncio.Task] = []

        async def timed_huge() -> None:
            huge_lat.append(await _decide(stub, huge))

        async def worker() -> None:
            for i in counter:
                if i % args.huge_every == args.huge_every // 2:  # the same huge load whatever the variant
                    huge_tasks.append(asyncio.create_task(timed_huge()))
                small_lat.append(await _decide(stub, small))

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        await asyncio.gather(*huge_tasks)
    return small_lat, huge_lat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--small", type=int, default=2000, help="small decisions per variant")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--huge-kb", type=int, default=1024, help="size of the huge prompt")
    parser.add_argument(
        "--huge-every", type=int, default=100, help="one huge prompt per this many small ones"
    )
    parser.add_argument("--serve", nargs=3, metavar=("PORT", "INLINE_BYTES", "KIND"), help=argparse.SUPPRESS)
    parser.add_argument("--output", help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    if args.serve:
        serve(int(args.serve[0]), int(args.serve[1]), args.serve[2])
        return 0
    rows = []
    load_before = os.getloadavg()[0]
    for name, (inline_bytes, kind) in VARIANTS.items():
        (port,) = free_ports(1)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.decision_stall",
                "--serve",
                str(port),
                str(inline_bytes),
                kind or "none",
            ]
        )
        try:

            def serving(address: str = f"127.0.0.1:{port}") -> bool:
                with grpc.insecure_channel(address) as ch:
                    grpc.channel_ready_future(ch).result(timeout=1)
                return True

            try:
                wait_until(serving, 30, "the decision service", interval=0, ignore=(grpc.FutureTimeoutError,))
            except TimedOut:
                raise RuntimeError("decision service did not start") from None
            cpu0 = cpu_seconds(proc.pid)
            small, huge = asyncio.run(load(port, args))
            cpu = cpu_seconds(proc.pid) - cpu0
        finally:
            proc.terminate()
            proc.wait(10)
        ms = [percentile(small, 50) * 1e3, percentile(small, 99) * 1e3, max(small) * 1e3]
        rows.append(
            (
                name,
                len(small),
                *ms,
                len(huge),
                percentile(huge, 50) * 1e3,
                cpu / (len(small) + len(huge)) * 1e3,
            )
        )
    lines = [
        f"Decision path alone (coordinator ext_proc service over gRPC, no Envoy): {args.small} small decisions "
        f"(~230-byte prompts) at concurrency {args.concurrency}, one {args.huge_kb} KiB prompt per "
        f"{args.huge_every} small ones; built-in tokenizer; load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after (2 shared cores). Latencies in ms.",
        "",
        "| tokenization | small decisions | small p50 | small p99 | small max | huge decisions | huge p50 | CPU s / 1k decisions |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, n, p50, p99, mx, nh, h50, cpu in rows:
        lines.append(f"| {name} | {n} | {p50:.2f} | {p99:.2f} | {mx:.2f} | {nh} | {h50:.1f} | {cpu:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
