"""The NodeAgent gRPC service: status, launch, stop and drain of this node's processes; LoRA adapters of its
engines (the coordinator's)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from node_agent.adapters import Outcome, check_name, check_path
from node_agent.coordinator_link import instance_message
from node_agent.supervisor import EngineState, EngineSupervisor
from tandem.v1 import node_agent_pb2, node_agent_pb2_grpc

_STATES = {
    EngineState.STARTING: node_agent_pb2.ENGINE_STATE_STARTING,
    EngineState.RUNNING: node_agent_pb2.ENGINE_STATE_RUNNING,
    EngineState.BACKOFF: node_agent_pb2.ENGINE_STATE_BACKOFF,
    EngineState.STOPPED: node_agent_pb2.ENGINE_STATE_STOPPED,
    EngineState.FAILED: node_agent_pb2.ENGINE_STATE_FAILED,
    EngineState.DRAINING: node_agent_pb2.ENGINE_STATE_DRAINING,
    EngineState.UNRESPONSIVE: node_agent_pb2.ENGINE_STATE_UNRESPONSIVE,
}


#: The gRPC status of each adapter outcome (node_agent.proto, `LoadAdapter`).
_ADAPTER_CODES = {
    Outcome.ALREADY_LOADED: grpc.StatusCode.ALREADY_EXISTS,
    Outcome.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Outcome.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Outcome.REFUSED: grpc.StatusCode.FAILED_PRECONDITION,
    Outcome.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


def engine_status(sup: EngineSupervisor, node_id: str) -> node_agent_pb2.EngineStatus:
    """What the agent reports about one process."""
    running = sup.running
    status = node_agent_pb2.EngineStatus(
        instance=instance_message(sup, node_id),
        state=_STATES[sup.reported_state],
        pid=sup.process.pid if running and sup.process is not None else 0,
        restarts=sup.restarts,
        argv=sup.spec.argv,
        detail=sup.detail,
        adopted=sup.adopted,
    )
    if sup.last_exit_code is not None:
        status.last_exit_code = sup.last_exit_code
    if running and sup.started_wall:
        started = Timestamp()
        started.FromNanoseconds(int(sup.started_wall * 1e9))
        status.started_at.CopyFrom(started)
    return status


class NodeAgentService(node_agent_pb2_grpc.NodeAgentServicer):
    """Operator access to this node's engines (and KV store)."""

    def __init__(
        self,
        node_id: str,
        supervisors: dict[str, EngineSupervisor],
        shutdown: Callable[[bool], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.supervisors = supervisors
        self.shutdown = shutdown  # starts the agent's shutdown (stop_engines) after the reply is sent

    async def _find(self, instance_id: str, context) -> EngineSupervisor:
        sup = self.supervisors.get(instance_id)
        if sup is None:
            known = ", ".join(self.supervisors) or "none"
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no engine {instance_id!r} on this node (known: {known})"
            )
        assert sup is not None  # abort raised
        return sup

    async def GetStatus(self, request, context) -> node_agent_pb2.GetStatusResponse:
        engines = [engine_status(s, self.node_id) for s in self.supervisors.values()]
        return node_agent_pb2.GetStatusResponse(node_id=self.node_id, engines=engines)

    async def Launch(self, request, context) -> node_agent_pb2.LaunchResponse:
        sup = await self._find(request.instance_id, context)
        sup.start()
        return node_agent_pb2.LaunchResponse(engine=engine_status(sup, self.node_id))

    async def Stop(self, request, context) -> node_agent_pb2.StopResponse:
        sup = await self._find(request.instance_id, context)
        await sup.stop()
        return node_agent_pb2.StopResponse(engine=engine_status(sup, self.node_id))

    async def Drain(self, request, context) -> node_agent_pb2.DrainResponse:
        """Deregisters the engine (no new requests), waits for its requests in flight (`vllm:num_requests_running`
        + `waiting` from /metrics) up to the engine's `drain_timeout_s` or the call's deadline, then stops it."""
        sup = await self._find(request.instance_id, context)
        if not sup.registrable:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{request.instance_id!r} serves no requests (headless rank or store): use Stop",
            )
        if sup.state is EngineState.DRAINING:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"{request.instance_id!r} is already draining"
            )
        assert sup.engine is not None  # registrable: an engine, not a store
        timeout = sup.engine.drain_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = max(0.0, min(timeout, remaining - sup.stop_grace_s - 1.0))
        await sup.drain(timeout)
        return node_agent_pb2.DrainResponse(engine=engine_status(sup, self.node_id))

    async def Shutdown(self, request, context) -> node_agent_pb2.ShutdownResponse:
        shutdown = self.shutdown
        if shutdown is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this agent cannot be shut down remotely")
            return node_agent_pb2.ShutdownResponse()
        running = [name for name, sup in self.supervisors.items() if sup.running]
        shutdown(request.stop_engines)
        if request.stop_engines:
            return node_agent_pb2.ShutdownResponse(stopping=running)
        return node_agent_pb2.ShutdownResponse(left_running=running)

    async def _lora_engine(self, instance_id: str, context) -> EngineSupervisor:
        sup = await self._find(instance_id, context)
        if not sup.lora_engine:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"engine {instance_id!r} was not launched with LoRA: give its model `adapters` or `max_loras` in "
                "the mesh file",
            )
        return sup

    async def LoadAdapter(self, request, context) -> node_agent_pb2.LoadAdapterResponse:
        problem = check_name(request.adapter_name) or check_path(request.adapter_path)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        sup = await self._lora_engine(request.instance_id, context)
        result = await sup.load_adapter(request.adapter_name, request.adapter_path, request.load_inplace)
        if result.outcome is not Outcome.OK:
            await context.abort(
                _ADAPTER_CODES[result.outcome],
                f"engine {request.instance_id!r} did not load adapter {request.adapter_name!r}: {result.message}",
            )
        return node_agent_pb2.LoadAdapterResponse(loaded_adapters=sup.adapters)

    async def UnloadAdapter(self, request, context) -> node_agent_pb2.UnloadAdapterResponse:
        problem = check_name(request.adapter_name)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        sup = await self._lora_engine(request.instance_id, context)
        result = await sup.unload_adapter(request.adapter_name)
        if result.outcome is not Outcome.OK:
            await context.abort(
                _ADAPTER_CODES[result.outcome],
                f"engine {request.instance_id!r} did not unload adapter {request.adapter_name!r}: {result.message}",
            )
        return node_agent_pb2.UnloadAdapterResponse(loaded_adapters=sup.adapters)
