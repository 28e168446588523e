"""Wires the coordinator process: picker core, ext_proc, Registry, Admin, Metaserver, mesh health, reloads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.auth.v3 import external_auth_pb2_grpc as ea_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from pydantic import ValidationError

from coordinator import mesh_health, metrics
from coordinator.access_log import AccessLogService
from coordinator.adapter_loader import AdapterLoader
from coordinator.adapter_placement import AdapterHolds
from coordinator.api_keys import ApiKeys
from coordinator.attempts import AttemptRegistry
from coordinator.capacity import DemandMeter, Limits, Sizing, fleet_sizing
from coordinator.config import MeshView, PdMode, SchedulerConfig
from coordinator.config_watch import watch_config
from coordinator.decision import Decider
from coordinator.etcd_state import EtcdState
from coordinator.ext_authz import Authorization
from coordinator.ext_proc import ExternalProcessor
from coordinator.flow_gate import FlowGate
from coordinator.handoff import HandoffRunner
from coordinator.instance_probe import HealthProber, health_answers
from coordinator.instances import InstanceTable
from coordinator.kv_match import ConductorMatcher
from coordinator.picker import EndpointPicker
from coordinator.predicted_cache import PredictedCache
from coordinator.quotas import SHARE_INTERVAL_S, Quotas, Use
from coordinator.relearn import RelearnWindow
from coordinator.routing_quality import TtftAttainment
from coordinator.services import AdminService, MetaserverService, RegistryService, publish_instance_counts
from coordinator.shared_state import LocalState, SharedState
from coordinator.tenants_watch import TenantsWatch, load_tenants, watch_tenants
from coordinator.tickets import TicketTable
from coordinator.trigger import TriggerCoordinator
from coordinator.understand_pool import UnderstandPool
from coordinator.understanding import TokenizerCache
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
EXT_AUTHZ_SERVICE = "envoy.service.auth.v3.Authorization"
ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"


@dataclass
class Coordinator:
    """The parts of one coordinator process."""

    app: GrpcApp
    shared: SharedState
    picker: EndpointPicker
    registry: RegistryService
    admin: AdminService
    matcher: ConductorMatcher
    tickets: TicketTable
    pool: UnderstandPool | None
    decider: Decider | None = None


#: Who may call what on the coordinator (`tandem.authz`; checked when the mesh runs with TLS).
RULES = {
    # Envoy's own calls only: a call Envoy proxies for someone else carries that caller's identity instead.
    # The decision calls (ext_proc or ext_authz, whichever the mesh's Envoy runs) and the access log that ends
    # each routed request's ticket.
    f"/{EXT_PROC_SERVICE}/": ("envoy",),
    f"/{EXT_AUTHZ_SERVICE}/": ("envoy",),
    f"/{ACCESS_LOG_SERVICE}/": ("envoy",),
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
    matcher = ConductorMatcher(
        mesh.conductor_match_address, config.scheduler.match_timeout_ms / 1000, tls=tls
    )
    ledger = WorkloadLedger()
    predicted = PredictedCache(config.scheduler.predicted_cache_lifetime_ms / 1000)
    picker = EndpointPicker(
        config,
        instances,
        ledger,
        config.scheduler.build(),
        tokenizers,
        matcher,
        predicted,
        fallbacks=mesh.destination_fallback,
        decode_policy=config.scheduler.build_decode(),
    )
    picker.max_model_len = {m.name: m.max_model_len for m in mesh.models if m.max_model_len}
    picker.adapters = {a.name: m.name for m in mesh.models for a in m.adapters}
    for model in mesh.models:  # load tokenizers now: a bad path fails at start, not on the first request
        tokenizers.get(model.name)
    # One decision call (ext_authz Check or ext_proc message) carries a whole buffered body: the gRPC limit
    # follows Envoy's buffer limit.
    options = [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ]
    app = GrpcApp("coordinator", config.listen, config.metrics_listen, options=options, tls=tls, rules=RULES)
    handoff = HandoffRunner(
        picker, config.prefill_timeout_s, config.prefill_attempts, config.callback_kv_hosts
    )
    trigger = TriggerCoordinator(handoff, AttemptRegistry(), mesh.metaserver_url, config.callback_kv_hosts)
    # Ticket ids start with the replica's name: Envoy sends each replica the access log of its own tickets.
    incarnation = f"{config.replica}.{os.urandom(4).hex()}"
    tickets = TicketTable(
        picker.ledger, config.ticket_lifetime_s, config.reconcile_grace_s, incarnation=incarnation
    )
    pool = None
    if config.decision_processes:
        paths = {m.name: m.tokenizer for m in mesh.models}
        pool = UnderstandPool(config.decision_processes, paths, config)
        app.on_stop(_closer(pool.close))
    api_keys = ApiKeys.load(config.api_keys_file, config.api_keys_env)
    tenants = load_tenants(config.tenants, config.tenants_file)
    decider = Decider(
        picker,
        handoff,
        trigger,
        tickets,
        pool,
        config.decision_inline_bytes,
        api_keys,
        tenants,
        config.engine_priority,
    )
    if picker.adapters:  # LoRA placement: loads onto the chosen engine through its node's agent
        settings = config.adapters
        holds = AdapterHolds(settings.failed_hold_s, settings.loaded_memory_s)
        picker.placement = holds
        adapter_paths = {a.name: a.path for m in mesh.models for a in m.adapters}
        decider.loader = AdapterLoader(mesh.control_address, tls, settings, holds, adapter_paths)
        app.on_stop(decider.loader.close)
    shared: SharedState = LocalState()
    if config.etcd is not None:
        shared = EtcdState(config.etcd.endpoint, config.etcd.prefix, config.instance_ttl)
    prober = HealthProber() if config.probe_instances else None
    demand = DemandMeter(config.sizing.window_s)
    limits = Limits(max_seqs=config.sizing.max_num_seqs, itl_s=config.sizing.itl_s)

    def sizing() -> list[Sizing]:
        return fleet_sizing(instances.all(), picker.latency, demand, limits)

    registry = RegistryService(
        instances,
        config,
        picker.ledger,
        shared,
        tls_on=tls is not None,
        book=mesh.node_book,
        prober=prober,
        latency=picker.latency,
        demand=demand,
    )
    decider.end_lag_s = mesh.request_end_lag_s
    if config.relearn_s > 0:  # a (re)started coordinator waits for the agents' registrations rather than 503
        decider.relearn = RelearnWindow(config.relearn_s)
        registry.on_registered = decider.relearn.registered
    if config.flow_control.enabled:  # SLO-aware admission: re-checked on every request's end and heartbeat
        decider.flow = FlowGate(config.flow_control, picker)
        tickets.on_any_release = decider.flow.kick
        registry.on_load = decider.flow.kick
    attainment = TtftAttainment({t.value: slo.ttft_slo_s for t, slo in config.flow_control.slos().items()})
    admin = AdminService(picker, decider.counters, mesh, shared, decider, sizing, attainment)
    # Both decision transports are served; Envoy's config says which one it calls (envoy.decision).
    ext_proc = ExternalProcessor(decider, config.prefill_budget_s, mesh.decision_timeout_s)
    app.add_service(EXT_PROC_SERVICE, ep_grpc.add_ExternalProcessorServicer_to_server, ext_proc)
    app.add_service(EXT_AUTHZ_SERVICE, ea_grpc.add_AuthorizationServicer_to_server, Authorization(decider))
    app.add_service(
        ACCESS_LOG_SERVICE,
        als_pb2_grpc.add_AccessLogServiceServicer_to_server,
        AccessLogService(tickets, attainment),
    )
    app.add_service("tandem.v1.Registry", registry_pb2_grpc.add_RegistryServicer_to_server, registry)
    app.add_service("tandem.v1.Admin", admin_pb2_grpc.add_AdminServicer_to_server, admin)
    metaserver = MetaserverService(trigger, config.replica)
    app.add_service("tandem.v1.Metaserver", metaserver_pb2_grpc.add_MetaserverServicer_to_server, metaserver)
    # Reflection on Envoy's :9000 is answered here, so it describes every service the listener routes.
    app.advertise(mesh_health.CONDUCTOR_SERVICE, mesh_health.NODE_AGENT_SERVICE)
    metrics.WORKLOAD.watch(picker.ledger, lambda: [s.info.instance_id for s in instances.all()])
    metrics.LATENCY.watch(picker.latency, lambda: [s.info.instance_id for s in instances.all()])
    metrics.SIZING.watch(sizing)
    metrics.TICKETS.watch(tickets)
    app.on_stop(registry.close)
    metrics.TENANTS.watch(decider)
    app.on_stop(handoff.close)
    app.on_stop(matcher.close)
    app.on_stop(shared.close)
    return Coordinator(app, shared, picker, registry, admin, matcher, tickets, pool, decider)


def _closer(close):
    async def on_stop() -> None:
        close()

    return on_stop


async def recheck_queue(gate: FlowGate, interval_s: float) -> None:
    """Checks the admission queue's heads every `interval_s` (see the caller)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            gate.kick()
        except Exception:
            log.exception("admission queue check failed")


async def settle_tickets(tickets: TicketTable, instances: InstanceTable, interval_s: float) -> None:
    """Releases tickets past their lifetime, and unconfirmed ones whose engines report idle."""
    while True:
        await asyncio.sleep(interval_s)
        expired = tickets.expire()
        if expired:
            log.warning("tickets expired without an access log entry", extra={"count": len(expired)})
        reconciled = tickets.reconcile({s.info.instance_id: s.load for s in instances.all()})
        if reconciled:
            log.info("tickets reconciled with idle engines", extra={"count": len(reconciled)})


async def expire_silent(
    picker: EndpointPicker,
    ttl_s: float,
    shared: SharedState | None = None,
    probe: Callable[[str], Awaitable[bool]] | None = None,
    probe_timeout_s: float = 1.0,
    registry: RegistryService | None = None,
    removal_s: float | None = None,
) -> None:
    """Marks instances silent for `ttl_s` unhealthy. Silent means no heartbeat from the agent and no answer of the
    engine itself: an instance whose agent has said nothing for half the lease is probed (`GET /health`), and one
    that answers keeps its health (and its shared lease) for another `ttl_s` (a frozen, restarting or partitioned
    agent does not make its healthy engines unroutable; a dead node's engines do not answer and expire as before).
    With `registry` and `removal_s`, instances silent that long are removed (their ids released)."""
    instances = picker.instances
    ask = probe or (lambda address: health_answers(address, probe_timeout_s))
    while True:
        await asyncio.sleep(min(ttl_s / 4, 1.0))
        candidates = instances.to_vouch(ttl_s)
        if candidates:
            answers = await asyncio.gather(*(ask(s.info.address) for s in candidates))
            for state, answered in zip(candidates, answers, strict=True):
                iid = state.info.instance_id
                if answered and instances.vouch(iid):
                    log.info("agent silent, engine answers its health probe: kept", extra={"instance": iid})
                    if shared is not None:
                        shared.reported(iid, state.health, state.load)  # keeps its lease in etcd
        expired = instances.expire(ttl_s)
        if expired:
            log.warning("instances silent, marked unhealthy", extra={"instances": expired})
            publish_instance_counts(instances)
        if registry is not None and removal_s is not None:
            removed = registry.remove_silent(removal_s)
            if removed:
                metrics.INSTANCES_REMOVED.inc(len(removed))
                log.warning("instances silent, removed", extra={"instances": removed})


def apply_shared_scheduler(mesh: MeshView, picker: EndpointPicker, matcher, section: dict) -> bool:
    """Switches to the scheduler section another replica published (etcd); True when it changed anything. A section
    that does not validate is logged and ignored (the running scheduler is kept)."""
    try:
        new = SchedulerConfig.model_validate(section)
        policies = new.build(), new.build_decode()
    except (ValidationError, ValueError) as exc:
        log.error("scheduler from etcd rejected, keeping the running one", extra={"error": str(exc)})
        return False
    if new.model_dump() == mesh.coordinator.scheduler.model_dump():
        return False
    picker.policy, picker.decode_policy = policies
    mesh.coordinator.scheduler = new
    matcher.timeout_s = new.match_timeout_ms / 1000
    log.info("scheduler from etcd applied", extra={"policy": new.policy})
    return True


async def publish_scheduler(mesh: MeshView, shared: EtcdState, interval_s: float = 0.5) -> None:
    """Publishes this replica's scheduler section when its mesh file reload changed it (after the store's own
    section, if any, was applied at connection: a starting replica does not override the mesh's)."""
    while True:
        await asyncio.sleep(interval_s)
        if shared.connected:
            shared.scheduler_set(mesh.coordinator.scheduler.model_dump(mode="json"))


async def publish_quotas(quotas: Quotas, shared: EtcdState, interval_s: float = SHARE_INTERVAL_S) -> None:
    """Publishes this replica's quota use when it changed, and at least every third of the lease (keeping the
    key alive while the replica lives)."""
    last: dict | None = None
    sent_at = 0.0
    while True:
        await asyncio.sleep(interval_s)
        share = quotas.share()
        now = time.monotonic()
        if shared.connected and (share != last or now - sent_at > shared.ttl / 3):
            shared.quotas_set(share)
            last, sent_at = share, now


async def run(
    mesh: MeshView, reload: Callable[[str], MeshView] | None = None, tls: TlsFiles | None = None
) -> None:
    """Serves until SIGTERM; `reload(path)` re-reads the mesh file when it changes (scheduler hot reload)."""
    c = build(mesh, tls)
    tasks: list[asyncio.Task] = []

    async def after_start() -> None:
        if isinstance(c.shared, EtcdState):
            shared = c.shared

            def on_scheduler(section: dict) -> None:
                apply_shared_scheduler(mesh, c.picker, c.matcher, section)

            shared.on_scheduler = on_scheduler
            tasks.append(asyncio.create_task(publish_scheduler(mesh, shared)))
            if c.decider is not None:  # tenant quotas hold mesh-wide (`coordinator/quotas.py`)
                decider = c.decider
                shared.replica = c.tickets.incarnation

                def on_quotas(replica: str, share: dict[str, Use] | None) -> None:
                    decider.quotas.peer(replica, share, decider.tenants.specs)

                shared.on_quotas = on_quotas
                tasks.append(asyncio.create_task(publish_quotas(decider.quotas, shared)))
        await c.shared.start(c.picker.instances)
        c.matcher.start()
        section = mesh.coordinator
        if section.pd_mode is not PdMode.AGGREGATED and c.decider is not None:
            # P/D may send prefill legs: their HTTP client is imported off the loop now, not on the first leg.
            tasks.append(asyncio.create_task(c.decider.handoff.warm()))
        tasks.append(
            asyncio.create_task(
                expire_silent(
                    c.picker,
                    section.instance_ttl,
                    c.shared,
                    registry=c.registry,
                    removal_s=section.instance_removal,
                )
            )
        )
        if c.pool is not None:
            tasks.append(asyncio.create_task(c.pool.start()))
        tasks.append(asyncio.create_task(settle_tickets(c.tickets, c.picker.instances, 1.0)))
        if c.decider is not None and c.decider.flow is not None:
            # Load this replica hears of only through the shared store (another replica's heartbeats, whose
            # requests end there) frees capacity without an event here: the queue's heads are re-checked anyway.
            interval = section.heartbeat_interval_s
            tasks.append(asyncio.create_task(recheck_queue(c.decider.flow, interval)))
        tasks.append(
            asyncio.create_task(
                mesh_health.watch_conductor(c.app.health, mesh.conductor.replica_endpoints[0], tls=tls)
            )
        )
        tasks.append(asyncio.create_task(mesh_health.watch_agents(c.app.health, c.registry)))
        if mesh.path and reload is not None:
            tasks.append(asyncio.create_task(watch_config(mesh, reload, c.picker, c.matcher)))
        config = mesh.coordinator
        if config.tenants_file and c.decider is not None:
            decider = c.decider

            def apply_tenants(table) -> None:
                decider.tenants = table

            watch = TenantsWatch(config.tenants, config.tenants_file, apply_tenants)
            watch.poll()  # the file as read at start-up: the digest to compare with
            tasks.append(asyncio.create_task(watch_tenants(watch)))

    async def cancel_tasks() -> None:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    c.app.on_stop(cancel_tasks)
    await c.app.run(after_start)
