"""The shell of LoRA adapter placement: loads an adapter onto the engine the picker chose, through that node's agent
(`NodeAgent.LoadAdapter`, reached through Envoy's control listener with the coordinator's certificate; the
`tandem-node` header names the node, and the agent allows the call to the coordinator alone). What to load where
is decided in `coordinator.adapter_placement`; this module only calls and records.

Bounded: one load in flight per (instance, adapter), shared by every request waiting for it (a cancelled request
does not cancel it); at most `max_loads_in_flight` loads at once; each within `load_timeout_s`, the wait for a load
slot included. A failed load answers the request with an OpenAI-style error (500 when the engine refused the
adapter or found nothing at its path; 503 when the agent or engine was unavailable or late) and holds the instance
back for that adapter for `failed_hold_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import grpc

from coordinator import metrics
from coordinator.adapter_placement import AdapterHolds, LoadFailure, needs_load, unload_victim
from coordinator.config import AdapterPlacementSettings
from coordinator.errors import OpenAIError
from coordinator.instances import InstanceState
from tandem.tls import TlsFiles, aio_channel
from tandem.v1 import node_agent_pb2, node_agent_pb2_grpc

log = logging.getLogger(__name__)

#: The header Envoy's control listener routes NodeAgent calls by (`mesh.envoy.NODE_HEADER`).
NODE_HEADER = "tandem-node"
#: Answers that mean the adapter itself (or the engine's LoRA setup) is at fault: retrying does not help.
_REFUSALS = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
}


class AdapterLoader:
    """Loads adapters where the picker sends their requests; see the module doc. `paths`: adapter name -> the path
    the engine reads it from (the mesh file's `models[].adapters`)."""

    def __init__(
        self,
        address: str,
        tls: TlsFiles | None,
        settings: AdapterPlacementSettings,
        holds: AdapterHolds,
        paths: Mapping[str, str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self.tls = tls
        self.settings = settings
        self.holds = holds
        self.paths = dict(paths)
        self._clock = clock
        self._channel: grpc.aio.Channel | None = None
        self._slots: asyncio.Semaphore | None = None
        self._inflight: dict[tuple[str, str], asyncio.Future[None]] = {}
        #: One load or unload at a time per instance: an adapter unloaded there is loaded again only after.
        self._instance_locks: dict[str, asyncio.Lock] = {}
        self._unloads: set[asyncio.Task[None]] = set()

    @property
    def loads_in_flight(self) -> int:
        return len(self._inflight)

    async def ensure(self, state: InstanceState, adapter: str) -> None:
        """Returns once `state`'s engine serves `adapter` (at once when it does already); OpenAIError when the load
        fails or is late."""
        iid = state.info.instance_id
        if not needs_load(state, adapter, self.holds.resident(state, self._clock())):
            return
        key = (iid, adapter)
        load = self._inflight.get(key)
        if load is None:
            load = self._inflight[key] = asyncio.ensure_future(self._load(state, adapter))
            load.add_done_callback(lambda _: self._inflight.pop(key, None))
        await asyncio.shield(load)

    async def _load(self, state: InstanceState, adapter: str) -> None:
        info = state.info
        timeout = self.settings.load_timeout_s
        where = f"instance `{info.instance_id}`"
        request = node_agent_pb2.LoadAdapterRequest(
            instance_id=info.instance_id, adapter_name=adapter, adapter_path=self.paths.get(adapter, "")
        )
        started = self._clock()
        try:
            async with asyncio.timeout(timeout):
                async with self._instance_lock(info.instance_id), self._slots_now():
                    stub = node_agent_pb2_grpc.NodeAgentStub(self._channel_now())
                    left = max(0.001, timeout - (self._clock() - started))
                    await stub.LoadAdapter(request, timeout=left, metadata=((NODE_HEADER, info.node_id),))
        except TimeoutError:
            self._failed(
                info.instance_id, adapter, f"the load on {where} took longer than {timeout:g} s", True
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.ALREADY_EXISTS:  # loaded meanwhile (by the agent or another replica)
                self._loaded(state, adapter)
                return
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                message = f"the load on {where} took longer than {timeout:g} s"
            else:
                message = f"the load on {where} failed: {exc.details() or code.name}"
            self._failed(info.instance_id, adapter, message, code not in _REFUSALS)
        else:
            self._loaded(state, adapter)
            log.info(
                "adapter loaded",
                extra={"instance": info.instance_id, "adapter": adapter, "seconds": self._clock() - started},
            )

    def _loaded(self, state: InstanceState, adapter: str) -> None:
        """Records the load, and unloads the engine's least recently used idle adapter when it now holds more than
        its slots (`adapter_placement.unload_victim`), in the background: the request goes on at once."""
        metrics.ADAPTER_LOADS.labels("ok").inc()
        holds, iid, now = self.holds, state.info.instance_id, self._clock()
        resident = holds.resident(state, now)
        holds.loaded(iid, adapter, now)
        victim = unload_victim(state, adapter, resident, holds.inflight(iid), holds.last_used(iid))
        if victim is not None:
            holds.unloaded(iid, victim, now)  # at once: no request follows it there from now on
            task = asyncio.create_task(self._unload(state, victim))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def _unload(self, state: InstanceState, adapter: str) -> None:
        info = state.info
        request = node_agent_pb2.UnloadAdapterRequest(instance_id=info.instance_id, adapter_name=adapter)
        try:
            async with asyncio.timeout(self.settings.load_timeout_s):
                async with self._instance_lock(info.instance_id), self._slots_now():
                    stub = node_agent_pb2_grpc.NodeAgentStub(self._channel_now())
                    await stub.UnloadAdapter(
                        request, timeout=self.settings.load_timeout_s, metadata=((NODE_HEADER, info.node_id),)
                    )
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.DEADLINE_EXCEEDED
            if code != grpc.StatusCode.NOT_FOUND:  # not gone: it stays resident as the heartbeat says
                metrics.ADAPTER_UNLOADS.labels("failed").inc()
                self.holds.unload_failed(info.instance_id, adapter)
                log.warning(
                    "adapter unload failed",
                    extra={"instance": info.instance_id, "adapter": adapter, "error": code.name},
                )
                return
        metrics.ADAPTER_UNLOADS.labels("ok").inc()
        log.info(
            "adapter unloaded (least recently used, idle)",
            extra={"instance": info.instance_id, "adapter": adapter},
        )

    def _instance_lock(self, instance_id: str) -> asyncio.Lock:
        lock = self._instance_locks.get(instance_id)
        if lock is None:
            lock = self._instance_locks[instance_id] = asyncio.Lock()
        return lock

    def _slots_now(self) -> asyncio.Semaphore:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.settings.max_loads_in_flight)
        return self._slots

    def _failed(self, instance_id: str, adapter: str, message: str, retryable: bool) -> None:
        metrics.ADAPTER_LOADS.labels("unavailable" if retryable else "failed").inc()
        self.holds.failed(instance_id, adapter, LoadFailure(message, retryable, self._clock()))
        log.warning(
            "adapter load failed", extra={"instance": instance_id, "adapter": adapter, "error": message}
        )
        raise OpenAIError(
            503 if retryable else 500,
            f"The adapter `{adapter}` could not be loaded: {message}. The instance is not chosen for it for "
            f"{self.holds.failed_hold_s:g} s.",
        )

    def _channel_now(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = aio_channel(self.address, self.tls, "envoy")
        return self._channel

    async def close(self) -> None:
        for task in [*self._inflight.values(), *self._unloads]:
            task.cancel()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
