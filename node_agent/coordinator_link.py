"""The agent's link to the coordinator's Registry: register running engines, stream heartbeats, deregister.

A reconcile loop makes the coordinator's view follow the supervisors: every interval it registers RUNNING
engines the coordinator does not know (first start, restart, coordinator restart) and sends one heartbeat per
registered engine on a long-lived stream; a health change is reported at once. A lost stream is opened again at
once (its coordinator was killed or restarted): the registrations of the new stream wait for the channel to be
ready (`wait_for_ready`) while gRPC tries to connect every `CONNECT_RETRY_MS`, so the engines are registered again
within about that long of a restarted coordinator listening, with no sleep of the agent's own in the way. Only a
stream that fails at once (an error other than a lost connection) is retried after `RECONNECT_S`, not in a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from node_agent.config import HANDOFF_CONNECTORS, TRIGGER_CONNECTORS, EngineConfig
from node_agent.supervisor import EngineState, EngineSupervisor
from tandem.netaddr import join_host_port
from tandem.tls import TlsFiles, aio_channel
from tandem.v1 import common_pb2, registry_pb2, registry_pb2_grpc

log = logging.getLogger(__name__)

#: Pause before opening again a stream that failed at once (not for a lost coordinator: that is waited for).
RECONNECT_S = 0.25
#: How often gRPC tries to connect to a coordinator that is down (its default backoff, 1 s growing to 120 s, would
#: leave a restarted coordinator without its instances for seconds). A refused loopback or LAN connection is cheap.
CONNECT_RETRY_MS = 100
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", CONNECT_RETRY_MS),
    ("grpc.min_reconnect_backoff_ms", CONNECT_RETRY_MS),
    ("grpc.max_reconnect_backoff_ms", CONNECT_RETRY_MS),
]
#: Deadline of a registration waiting for the coordinator to be reachable (the stream is then opened again).
REGISTER_WAIT_S = 5.0


def reconnect_delay(stream_lasted_s: float) -> float:
    """Pause before opening the heartbeat stream again: none after a stream that had lived (the coordinator went
    away; the next stream's calls wait for it to be reachable again), `RECONNECT_S` after one that failed at once
    (an error that opening it again right away would repeat)."""
    return 0.0 if stream_lasted_s >= RECONNECT_S else RECONNECT_S


_ROLES = {
    "hybrid": common_pb2.ROLE_HYBRID,
    "prefill": common_pb2.ROLE_PREFILL,
    "decode": common_pb2.ROLE_DECODE,
}


def dispatch_capability(engine: EngineConfig) -> common_pb2.DispatchCapability:
    """How requests reach an engine, from its connector: layerwise (decode calls the metaserver back) is trigger,
    another P/D connector on a prefill or decode engine is handoff, anything else is aggregated."""
    if engine.role == "hybrid" or not engine.kv_connector:
        return common_pb2.DISPATCH_CAPABILITY_AGGREGATED
    if engine.kv_connector in TRIGGER_CONNECTORS:
        return common_pb2.DISPATCH_CAPABILITY_TRIGGER
    if engine.kv_connector in HANDOFF_CONNECTORS:
        return common_pb2.DISPATCH_CAPABILITY_HANDOFF
    return common_pb2.DISPATCH_CAPABILITY_AGGREGATED


def instance_message(sup: EngineSupervisor, node_id: str) -> common_pb2.Instance:
    """The `Instance` an engine process registers as (a store or headless rank describes itself the same way)."""
    engine = sup.engine
    if engine is None:
        return common_pb2.Instance(instance_id=sup.name, node_id=node_id, backend="kv_store")
    port = sup.spec.port if sup.spec.port is not None else engine.port
    return common_pb2.Instance(
        instance_id=sup.name,
        model=engine.model,
        address=join_host_port(engine.host, port),
        role=_ROLES[engine.role],
        dispatch_capability=dispatch_capability(engine),
        node_id=node_id,
        backend=engine.backend,
        block_size=engine.block_size,
        data_parallel_size=sup.spec.data_parallel_size,
        kv_connector=engine.kv_connector or "",
    )


def heartbeat_message(sup: EngineSupervisor) -> registry_pb2.HeartbeatRequest:
    """One report on an engine."""
    sampled = Timestamp()
    if sup.load.sampled_at:
        sampled.FromNanoseconds(int(sup.load.sampled_at * 1e9))
    return registry_pb2.HeartbeatRequest(
        instance_id=sup.name,
        health=common_pb2.HEALTH_HEALTHY if sup.healthy else common_pb2.HEALTH_UNHEALTHY,
        load=common_pb2.InstanceLoad(
            running_requests=sup.load.running,
            waiting_requests=sup.load.waiting,
            kv_cache_usage=sup.load.kv_cache_usage,
            sampled_at=sampled if sup.load.sampled_at else None,
            progress=[
                common_pb2.RankProgress(
                    dp_rank=rank,
                    prompt_tokens_total=p,
                    generation_tokens_total=g,
                    prefix_cache_hits_total=sup.load.prefix_hits.get(rank, 0),
                )
                for rank, (p, g) in sup.load.progress.items()
            ],
            loaded_adapters=sup.adapters,
            max_loras=sup.engine.lora_slots if sup.engine is not None and sup.engine.lora_enabled else 0,
            kv_transfer_failures_total=sup.load.kv_transfer_failures,
            kv_transfers_total=sup.load.kv_transfers,
            kv_blocks=sup.load.kv_blocks,
        ),
    )


class CoordinatorLink:
    """Keeps the coordinator's Registry in step with this node's engines."""

    def __init__(
        self,
        address: str,
        node_id: str,
        supervisors: Callable[[], list[EngineSupervisor]],
        tls: TlsFiles | None = None,
    ) -> None:
        self.address = address
        self.node_id = node_id
        self.supervisors = supervisors
        self.interval_s = 2.0
        self.registered: set[str] = set()
        self._channel = aio_channel(address, tls, "coordinator", CHANNEL_OPTIONS)
        self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        self._wake = asyncio.Event()
        self._outbox: asyncio.Queue[registry_pb2.HeartbeatRequest | None] | None = None  # of the open stream

    def load_reported(self, sup: EngineSupervisor) -> None:
        """Called after each scrape of an engine's `/metrics`: relays its load and progress counters at once (the
        coordinator's ledger follows prefill progress from them), between the regular heartbeats."""
        outbox = self._outbox
        if outbox is not None and sup.name in self.registered and not outbox.full():
            outbox.put_nowait(heartbeat_message(sup))

    async def changed(self, sup: EngineSupervisor) -> None:
        """Called on every supervisor transition: registers or deregisters at once."""
        iid = sup.name
        if not sup.registrable:
            return
        if sup.state is EngineState.RUNNING and sup.healthy and iid not in self.registered:
            await self._register(sup)
        elif sup.state is not EngineState.RUNNING and iid in self.registered:
            await self.deregister(iid, sup.detail or sup.state.name.lower())
        elif iid in self.registered:
            self._wake.set()  # a health change: heartbeat now, not at the next interval

    async def _register(self, sup: EngineSupervisor, wait: bool = False) -> None:
        """Registers one engine; with `wait`, the call waits (up to `REGISTER_WAIT_S`) for an unreachable coordinator
        to come back instead of failing at once (the stream loop; a supervisor's transition does not wait)."""
        try:
            reply = await self._stub.Register(
                registry_pb2.RegisterRequest(instance=instance_message(sup, self.node_id)),
                timeout=REGISTER_WAIT_S if wait else 5,
                wait_for_ready=wait,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "register failed, will retry",
                extra={"instance": sup.name, "error": exc.details()},
            )
            return
        self.registered.add(sup.name)
        if reply.HasField("heartbeat_interval"):
            self.interval_s = max(0.1, reply.heartbeat_interval.ToMilliseconds() / 1000)
        if sup.state is not EngineState.RUNNING:
            # It exited while the call was out: its transition found it not yet registered, so undo it here.
            await self.deregister(sup.name, sup.detail or sup.state.name.lower())
            return
        log.info("registered with coordinator", extra={"instance": sup.name})
        self._wake.set()

    async def deregister(self, instance_id: str, reason: str) -> None:
        """Tells the coordinator an engine is gone (best effort)."""
        self.registered.discard(instance_id)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub.Deregister(
                registry_pb2.DeregisterRequest(instance_id=instance_id, reason=reason), timeout=5
            )

    async def run(self) -> None:
        """Reconcile and heartbeat until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            opened = loop.time()
            try:
                await self._stream()
            except grpc.aio.AioRpcError as exc:
                log.warning("heartbeat stream lost", extra={"error": exc.code().name})
            # The coordinator may have restarted without our instances: register everything again.
            self.registered.clear()
            delay = reconnect_delay(loop.time() - opened)
            if delay:
                await asyncio.sleep(delay)

    async def _stream(self) -> None:
        outbox: asyncio.Queue[registry_pb2.HeartbeatRequest | None] = asyncio.Queue(maxsize=1024)
        self._outbox = outbox

        async def requests():
            while (message := await outbox.get()) is not None:  # None: the stream is over
                yield message

        call = self._stub.Heartbeat(requests(), wait_for_ready=True)

        async def read() -> None:
            async for reply in call:
                if not reply.known:
                    self.registered.discard(reply.instance_id)
                    self._wake.set()

        reader = asyncio.create_task(read())
        reader.add_done_callback(
            lambda _: self._wake.set()
        )  # the stream ended: notice it now, not at the interval
        try:
            while not reader.done():
                self._wake.clear()  # before the pass: a wake during it (the stream ended, a health change) is kept
                for sup in self.supervisors():
                    if not sup.registrable:
                        continue
                    iid = sup.name
                    if sup.state is EngineState.RUNNING and sup.healthy and iid not in self.registered:
                        await self._register(sup, wait=True)
                        if reader.done():
                            break
                    if iid in self.registered and not outbox.full():
                        outbox.put_nowait(heartbeat_message(sup))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await self._wake.wait()
            reader.result()
        finally:
            self._outbox = None
            # Ends the request iterator, which gRPC would otherwise keep awaiting after the call is gone. A full
            # outbox needs no end: gRPC's next write on the cancelled call ends it.
            with contextlib.suppress(asyncio.QueueFull):
                outbox.put_nowait(None)
            reader.cancel()
            call.cancel()

    async def close(self) -> None:
        """Closes the channel."""
        await self._channel.close()
