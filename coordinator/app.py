"""Wires the coordinator process: picker core, ext_proc, Registry, Admin, Metaserver, mesh health, reloads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from coordinator import mesh_health, metrics
from coordinator.api_keys import ApiKeys
from coordinator.attempts import AttemptRegistry
from coordinator.config import MeshView
from coordinator.config_watch import watch_config
from coordinator.ext_proc import ExternalProcessor
from coordinator.handoff import HandoffRunner
from coordinator.instances import InstanceTable
from coordinator.kv_match import ConductorMatcher
from coordinator.picker import EndpointPicker, TokenizerCache
from coordinator.services import AdminService, MetaserverService, RegistryService, publish_instance_counts
from coordinator.trigger import TriggerCoordinator
from coordinator.workload import WorkloadLedger
from tandem.grpc_server import GrpcApp
from tandem.limits import MAX_GRPC_MESSAGE_BYTES
from tandem.tls import CALLBACK_ROLE, TlsFiles
from tandem.tokenizer import load_tokenizer
from tandem.v1 import (  # noqa: F401 - conductor_pb2 and node_agent_pb2 put their descriptors in reflection's pool
    admin_pb2_grpc,
    conductor_pb2,
    metaserver_pb2_grpc,
    node_agent_pb2,
    registry_pb2_grpc,
)

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass
class Coordinator:
    """The parts of one coordinator process."""

    app: GrpcApp
    picker: EndpointPicker
    registry: RegistryService
    admin: AdminService
    matcher: ConductorMatcher


#: Who may call what on the coordinator (`tandem.authz`; checked when the mesh runs with TLS).
RULES = {
    # Envoy's own calls only: a call Envoy proxies for someone else carries that caller's identity instead.
    f"/{EXT_PROC_SERVICE}/": ("envoy",),
    "/envoy.service.auth.v3.Authorization/": ("envoy",),
    "/envoy.service.accesslog.v3.AccessLogService/": ("envoy",),
    # Node agents; which instance ids each may touch is checked per request (RegistryService).
    "/tandem.v1.Registry/": ("agent/*",),
    "/tandem.v1.Admin/": ("operator",),
    # Only through Envoy's callback listener; the per-attempt token in the URL is checked per request.
    "/tandem.v1.Metaserver/": (CALLBACK_ROLE,),
}


def build(mesh: MeshView, tls: TlsFiles | None = None) -> Coordinator:
    """The coordinator's gRPC app, ready to run (mutual TLS and authorization with `tls`)."""
    config = mesh.coordinator
    instances = InstanceTable(m.name for m in mesh.models)
    tokenizers = TokenizerCache({m.name: m.tokenizer for m in mesh.models}, load_tokenizer)
    matcher = ConductorMatcher(mesh.conductor.listen, config.scheduler.match_timeout_ms / 1000, tls=tls)
    picker = EndpointPicker(
        config, instances, WorkloadLedger(), config.scheduler.build(), tokenizers, matcher
    )
    picker.max_model_len = {m.name: m.max_model_len for m in mesh.models if m.max_model_len}
    for model in mesh.models:  # load tokenizers now: a bad path fails at start, not on the first request
        tokenizers.get(model.name)
    # One ext_proc message carries a whole buffered body: the gRPC limit follows Envoy's buffer limit.
    options = [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ]
    app = GrpcApp("coordinator", config.listen, config.metrics_listen, options=options, tls=tls, rules=RULES)
    handoff = HandoffRunner(picker, config.prefill_timeout_s, config.prefill_attempts)
    trigger = TriggerCoordinator(handoff, AttemptRegistry(), mesh.metaserver_url, config.callback_kv_hosts)
    api_keys = ApiKeys.load(config.api_keys_file, config.api_keys_env)
    ext_proc = ExternalProcessor(picker, handoff, trigger, config.prefill_budget_s, api_keys)
    registry = RegistryService(instances, config, tls_on=tls is not None)
    admin = AdminService(picker, ext_proc.counters, mesh)
    app.add_service(EXT_PROC_SERVICE, ep_grpc.add_ExternalProcessorServicer_to_server, ext_proc)
    app.add_service("tandem.v1.Registry", registry_pb2_grpc.add_RegistryServicer_to_server, registry)
    app.add_service("tandem.v1.Admin", admin_pb2_grpc.add_AdminServicer_to_server, admin)
    metaserver = MetaserverService(trigger, config.replica)
    app.add_service("tandem.v1.Metaserver", metaserver_pb2_grpc.add_MetaserverServicer_to_server, metaserver)
    # Reflection on Envoy's :9000 is answered here, so it describes every service the listener routes.
    app.advertise(mesh_health.CONDUCTOR_SERVICE, mesh_health.NODE_AGENT_SERVICE)
    metrics.WORKLOAD.watch(picker.ledger, lambda: [s.info.instance_id for s in instances.all()])
    app.on_stop(handoff.close)
    app.on_stop(matcher.close)
    return Coordinator(app, picker, registry, admin, matcher)


async def expire_silent(picker: EndpointPicker, interval_s: float) -> None:
    """Marks instances without heartbeats for three intervals unhealthy."""
    while True:
        await asyncio.sleep(interval_s)
        expired = picker.instances.expire(3 * interval_s)
        if expired:
            log.warning("instances silent, marked unhealthy", extra={"instances": expired})
            publish_instance_counts(picker.instances)


async def run(
    mesh: MeshView, reload: Callable[[str], MeshView] | None = None, tls: TlsFiles | None = None
) -> None:
    """Serves until SIGTERM; `reload(path)` re-reads the mesh file when it changes (scheduler hot reload)."""
    c = build(mesh, tls)
    tasks: list[asyncio.Task] = []

    async def after_start() -> None:
        c.matcher.start()
        tasks.append(asyncio.create_task(expire_silent(c.picker, mesh.coordinator.heartbeat_interval_s)))
        tasks.append(
            asyncio.create_task(mesh_health.watch_conductor(c.app.health, mesh.conductor.listen, tls=tls))
        )
        tasks.append(asyncio.create_task(mesh_health.watch_agents(c.app.health, c.registry)))
        if mesh.path and reload is not None:
            tasks.append(asyncio.create_task(watch_config(mesh, reload, c.picker, c.matcher)))

    async def cancel_tasks() -> None:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    c.app.on_stop(cancel_tasks)
    await c.app.run(after_start)
