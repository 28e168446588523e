"""gRPC shells of the coordinator: Registry (node agents), Admin (operators), Metaserver (trigger callbacks)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
import yaml
from google.protobuf.duration_pb2 import Duration

from coordinator import metrics
from coordinator.admission import NodeBook, registration_refusal
from coordinator.attempts import PrefillLegFailed, UnknownAttempt
from coordinator.capacity import DemandMeter, Sizing
from coordinator.config import CoordinatorConfig
from coordinator.convert import (
    HEALTH_NAMES,
    decision_to_proto,
    instance_from_proto,
    load_from_proto,
    status_to_proto,
)
from coordinator.decision import Decider, RequestCounters
from coordinator.flow_gate import FlowGate
from coordinator.instance_probe import HealthProber
from coordinator.instances import Health, InstanceState, InstanceTable
from coordinator.latency import LatencyBook
from coordinator.ownership import ownership_problem
from coordinator.picker import EndpointPicker
from coordinator.redact import redact
from coordinator.routing_quality import DeliveredHits, TtftAttainment
from coordinator.shared_state import LocalState, SharedState
from coordinator.trigger import CallbackRefused, TriggerCoordinator
from coordinator.workload import WorkloadLedger
from tandem.authz import refuse
from tandem.logs import request_id_var
from tandem.tls import agent_node, caller_var
from tandem.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    metaserver_pb2,
    metaserver_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)

log = logging.getLogger(__name__)


def publish_instance_counts(instances: InstanceTable) -> None:
    """Refreshes the instances-by-health gauge."""
    counts = {h: 0 for h in Health}
    for state in instances.all():  # an instance not yet answering its probe counts as starting
        counts[state.health if state.verified else Health.STARTING] += 1
    for health, count in counts.items():
        metrics.INSTANCES.labels(health.name.lower()).set(count)


class RegistryService(registry_pb2_grpc.RegistryServicer):
    """Node agents register instances and report their health and load; with TLS, each agent only its own
    node's instances, at its own hosts, up to a cap (`coordinator.ownership`, `coordinator.admission`). With a
    `prober`, a new instance is routable only once it answered its health probe."""

    def __init__(
        self,
        instances: InstanceTable,
        config: CoordinatorConfig,
        ledger: WorkloadLedger | None = None,
        shared: SharedState | None = None,
        tls_on: bool = False,
        book: NodeBook | None = None,
        prober: HealthProber | None = None,
        latency: LatencyBook | None = None,
        demand: DemandMeter | None = None,
    ) -> None:
        self.instances = instances
        self.config = config
        self.ledger = ledger  # follows each instance's progress counters, as heartbeats carry them
        self.latency = latency  # learns each instance's step costs from what the ledger saw done
        self.demand = demand  # each model's recent demand, for the P:D sizing signal (`coordinator.capacity`)
        self.delivered = DeliveredHits()  # the engines' prefix-cache hits, for the routing-quality SLIs
        self.shared = shared or LocalState()  # where other replicas learn what this one hears
        self.tls_on = tls_on
        self.book = book or NodeBook()
        self.prober = prober
        self._probes: dict[str, asyncio.Task] = {}  # instance id -> its probe loop, until it answers
        self._orphan_checks: set[asyncio.Task] = set()  # probes of a gone agent's engines (`_check_orphans`)
        self.open_streams = 0  # heartbeat streams of live agents, for the mesh health view
        self.on_registered: Callable[[], None] | None = (
            None  # on a registration and when a probed instance turns routable: wakes the relearn window
        )
        #: Called after every heartbeat of a known instance (its load and progress applied): capacity may have
        #: freed, e.g. for the admission queue (`coordinator/flow_gate.py`).
        self.on_load: Callable[[], None] | None = None

    def _owner(self, instance_id: str) -> str | None:
        state = self.instances.get(instance_id)
        return None if state is None else state.info.node_id

    async def _check_owner(self, context, method: str, instance_id: str, claimed_node: str = "") -> None:
        caller = caller_var.get()
        problem = ownership_problem(caller, self.tls_on, claimed_node, self._owner(instance_id))
        if problem is not None:
            refuse(f"/tandem.v1.Registry/{method}", caller)
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, f"permission denied: instance {instance_id!r}: {problem}"
            )

    async def Register(self, request: registry_pb2.RegisterRequest, context) -> registry_pb2.RegisterResponse:
        try:
            info = instance_from_proto(request.instance)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await self._check_owner(context, "Register", info.instance_id, info.node_id)
        node = agent_node(caller_var.get()) if self.tls_on else None
        if node is not None and not info.node_id:  # the certificate says which node registers it
            info = dataclasses.replace(info, node_id=node)
        refusal = registration_refusal(
            self.book,
            node,
            info,
            self._owner(info.instance_id),
            self.instances.count_node(node, besides=info.instance_id) if node else 0,
            self.config.max_instances_per_node,
        )
        if refusal is not None:
            metrics.REGISTRATIONS_REFUSED.labels(refusal.code.name.lower()).inc()
            if refusal.code is grpc.StatusCode.PERMISSION_DENIED:
                refuse("/tandem.v1.Registry/Register", caller_var.get())
            log.warning(
                "registration refused", extra={"instance": info.instance_id, "error": refusal.message}
            )
            await context.abort(refusal.code, refusal.message)
        old = self.instances.get(info.instance_id)
        # The same serving engine registering again (its agent restarted) stays routable, and is probed once to
        # confirm (a whole node restarted: its agent re-registers engines it is still relaunching); anything new,
        # or an engine found dead, is probed first.
        verified = self.prober is None or (
            old is not None and old.verified and old.health is Health.HEALTHY and old.info == info
        )
        state = self.instances.register(info, verified=verified)
        if self.ledger is not None:
            # A (re)started engine or a restarted agent: the next report of its counters is a new baseline.
            self.ledger.forget_progress(info.instance_id)
            self.ledger.set_prefill_rate(info.instance_id, self.config.scheduler.prefill_rate_tokens_per_s)
        self.shared.registered(info, verified)
        if self.prober is not None:
            self._start_probe(state)
        if self.on_registered is not None:
            self.on_registered()
        publish_instance_counts(self.instances)
        log.info(
            "registered",
            extra={
                "instance": info.instance_id,
                "model": info.model,
                "address": info.address,
                "verified": verified,
            },
        )
        interval = Duration()
        interval.FromMilliseconds(int(self.config.heartbeat_interval_s * 1000))
        return registry_pb2.RegisterResponse(heartbeat_interval=interval)

    async def Heartbeat(
        self, request_iterator: AsyncIterator[registry_pb2.HeartbeatRequest], context
    ) -> AsyncIterator[registry_pb2.HeartbeatResponse]:
        self.open_streams += 1
        heard: set[str] = set()  # the known instances this agent reported on this stream
        try:
            async for beat in request_iterator:
                await self._check_owner(context, "Heartbeat", beat.instance_id)
                health = HEALTH_NAMES.get(beat.health, Health.UNHEALTHY)
                load = load_from_proto(beat.load)
                before = self.instances.get(beat.instance_id)
                was_busy = before is not None and before.load.running > 0
                known = self.instances.heartbeat(beat.instance_id, health, load)
                if known and load.progress and self.ledger is not None:
                    done = self.ledger.engine_progress(beat.instance_id, load.progress)
                    if self.latency is not None:
                        self.latency.observe(beat.instance_id, done, was_busy and load.running > 0)
                    if self.demand is not None and before is not None:
                        queued = self.ledger.committed_prefill_tokens(beat.instance_id)
                        self.demand.observe(before.info.model, beat.instance_id, done, queued)
                if known:
                    heard.add(beat.instance_id)
                    self.shared.reported(beat.instance_id, health, load)
                    if self.on_load is not None:
                        self.on_load()
                    if load.prefix_hits:
                        self._delivered(beat.instance_id, load.prefix_hits)
                yield registry_pb2.HeartbeatResponse(instance_id=beat.instance_id, known=known)
        finally:
            self.open_streams -= 1
            publish_instance_counts(self.instances)
            if heard and self.prober is not None:
                self._start_orphan_check(heard, time.time())

    def _delivered(self, instance_id: str, hits) -> None:
        tokens = self.delivered.delta(instance_id, hits)
        state = self.instances.get(instance_id)
        if tokens and state is not None:
            metrics.routing_delivered(state.info.model, instance_id, tokens)

    async def Deregister(
        self, request: registry_pb2.DeregisterRequest, context
    ) -> registry_pb2.DeregisterResponse:
        await self._check_owner(context, "Deregister", request.instance_id)
        state = self.remove(request.instance_id)
        log.info("deregistered", extra={"instance": request.instance_id, "reason": request.reason})
        return registry_pb2.DeregisterResponse(found=state is not None)

    def remove(self, instance_id: str) -> InstanceState | None:
        """Takes an instance out of the registry (and the shared store), releasing its id."""
        state = self.instances.deregister(instance_id)
        if self.latency is not None:
            self.latency.forget(instance_id)
        if self.demand is not None:
            self.demand.forget(instance_id)
        probe = self._probes.pop(instance_id, None)
        if probe is not None:
            probe.cancel()
        self.shared.deregistered(instance_id)
        publish_instance_counts(self.instances)
        return state

    def remove_silent(self, max_silence_s: float) -> list[str]:
        """Removes the instances whose agent has been silent for longer than `max_silence_s`; returns their ids."""
        silent = self.instances.silent(max_silence_s)
        for instance_id in silent:
            self.remove(instance_id)
        return silent

    def _start_probe(self, state: InstanceState) -> None:
        iid = state.info.instance_id
        old = self._probes.pop(iid, None)
        if old is not None:
            old.cancel()
        self._probes[iid] = asyncio.create_task(self._probe(state), name=f"probe-{iid}")

    async def _probe(self, state: InstanceState) -> None:
        """Probes until the instance answers (then it is routable) or leaves the table (then the loop ends), following
        its table entry if it is replaced. A re-registered instance kept routable that does not answer is unroutable
        until it does."""
        assert self.prober is not None
        iid = state.info.instance_id
        try:
            while (current := self.instances.get(iid)) is not None:
                # Replaced in the table meanwhile (with replicas, another replica's registration of the same instance,
                # applied from etcd): probe the entry now in the table, or it would stay unverified here for good.
                state = current
                answered = await self.prober.answers(state.info.address)
                if self.instances.get(iid) is not state:
                    continue
                if answered:
                    # This replica's own record says so too, even when another replica's record (applied from etcd)
                    # said it first: its registration wrote `verified: false`, and every heartbeat it relays
                    # rewrites that record, which would turn the instance unroutable again on every replica.
                    self.shared.verified(iid)
                    if not state.verified:
                        state.verified = True
                        publish_instance_counts(self.instances)
                        log.info("instance answered its probe", extra={"instance": iid})
                        # Routable now: decisions waiting for one try again.
                        if self.on_registered is not None:
                            self.on_registered()
                    return
                if state.verified:  # kept routable at re-registration, and it does not answer
                    state.verified = False
                    self.shared.registered(state.info, False)
                    publish_instance_counts(self.instances)
                    log.warning("re-registered instance does not answer its probe", extra={"instance": iid})
                await asyncio.sleep(self.prober.interval_s)
        finally:
            if self._probes.get(iid) is asyncio.current_task():
                del self._probes[iid]

    def _start_orphan_check(self, instance_ids: set[str], ended_at: float) -> None:
        task = asyncio.create_task(self._check_orphans(instance_ids, ended_at), name="orphan-check")
        self._orphan_checks.add(task)
        task.add_done_callback(self._orphan_checks.discard)

    async def _check_orphans(self, instance_ids: set[str], ended_at: float) -> None:
        """An agent's heartbeat stream ended (the agent died, restarts or lost its connection): its engines are
        asked at once instead of after the silence TTL. One that does not answer is unhealthy now, so a dead node's
        engines stop receiving requests within a probe's deadline; one that answers keeps serving (its agent
        restarts and adopts it). An instance heard from again since the stream ended is left to that report."""
        assert self.prober is not None
        states = [
            s
            for iid in instance_ids
            if (s := self.instances.get(iid)) is not None and s.health is Health.HEALTHY
        ]
        answers = await asyncio.gather(*(self.prober.answers(s.info.address) for s in states))
        dead = [
            s
            for s, answered in zip(states, answers, strict=True)
            if not answered
            and self.instances.get(s.info.instance_id) is s
            and s.last_heartbeat_at <= ended_at
            and s.health is Health.HEALTHY
        ]
        for state in dead:
            state.health = Health.UNHEALTHY
            self.shared.reported(state.info.instance_id, Health.UNHEALTHY, state.load)
        if dead:
            publish_instance_counts(self.instances)
            log.warning(
                "agent gone and its engines do not answer: marked unhealthy",
                extra={"instances": sorted(s.info.instance_id for s in dead)},
            )

    async def close(self) -> None:
        """Stops the probes in flight."""
        for task in [*self._probes.values(), *self._orphan_checks]:
            task.cancel()
        self._probes.clear()
        if self.prober is not None:
            await self.prober.close()


def sizing_to_proto(z: Sizing) -> admin_pb2.ModelSizing:
    return admin_pb2.ModelSizing(
        model=z.model,
        aggregated=z.aggregated,
        prefill_tokens_per_s=z.demand.prefill_tokens_s,
        output_tokens_per_s=z.demand.output_tokens_s,
        mean_context_tokens=z.demand.mean_context,
        prefill_utilisation=z.prefill_utilisation,
        decode_utilisation=z.decode_utilisation,
        utilisation=z.utilisation,
        prefill_instances=z.prefill,
        decode_instances=z.decode,
        suggested_prefill_instances=z.suggested_prefill,
        suggested_decode_instances=z.suggested_decode,
        decode_batch=z.decode_batch,
    )


class AdminService(admin_pb2_grpc.AdminServicer):
    """The operator's view: instances, drain, config, stats."""

    def __init__(
        self,
        picker: EndpointPicker,
        counters: RequestCounters,
        mesh,
        shared: SharedState | None = None,
        decider: Decider | None = None,
        sizing: Callable[[], list[Sizing]] | None = None,
        attainment: TtftAttainment | None = None,
    ) -> None:
        self.shared = shared or LocalState()
        self.attainment = attainment  # each tier's TTFT objective met (`routing_quality.TtftAttainment`)
        self.picker = picker
        self.counters = counters
        self.decider = decider  # its tenants and quotas (GetStats)
        self.sizing = sizing  # each model's P:D sizing signal now (`coordinator.capacity.fleet_sizing`)
        self.mesh = mesh  # the running config; its scheduler section follows reloads

    def _status(self, instance_id: str):
        state = self.picker.instances.get(instance_id)
        if state is None:
            return None
        return status_to_proto(state, self.picker.ledger)

    async def ListInstances(self, request, context) -> admin_pb2.ListInstancesResponse:
        states = [
            s for s in self.picker.instances.all() if not request.model or s.info.model == request.model
        ]
        return admin_pb2.ListInstancesResponse(instances=[self._status(s.info.instance_id) for s in states])

    async def _set_drained(self, instance_id: str, drained: bool, context):
        state = self.picker.instances.get(instance_id)
        if state is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no instance {instance_id!r} is registered")
        assert state is not None  # abort raised
        state.drained = drained
        self.shared.drain_set(instance_id, drained)
        log.info("drained" if drained else "undrained", extra={"instance": instance_id})
        return self._status(instance_id)

    async def DrainInstance(self, request, context) -> admin_pb2.DrainInstanceResponse:
        return admin_pb2.DrainInstanceResponse(
            instance=await self._set_drained(request.instance_id, True, context)
        )

    async def UndrainInstance(self, request, context) -> admin_pb2.UndrainInstanceResponse:
        status = await self._set_drained(request.instance_id, False, context)
        return admin_pb2.UndrainInstanceResponse(instance=status)

    async def GetConfig(self, request, context) -> admin_pb2.GetConfigResponse:
        return admin_pb2.GetConfigResponse(yaml=config_as_yaml(self.mesh), path=self.mesh.path)

    def _queue_stats(self) -> list[admin_pb2.QueueStats]:
        gate = self.decider.flow if self.decider is not None else None
        return _queue_stats_of(gate) if gate is not None else []

    def _ttft_slo(self) -> list[admin_pb2.TtftSloStats]:
        a = self.attainment
        if a is None:
            return []
        return [
            admin_pb2.TtftSloStats(
                tier=tier, ttft_slo_seconds=a.slo_s.get(tier, 0.0), measured=c[0], within_slo=c[1]
            )
            for tier, c in sorted(a.counts.items())
        ]

    async def ListDecisions(self, request, context) -> admin_pb2.ListDecisionsResponse:
        log = self.picker.decisions
        return admin_pb2.ListDecisionsResponse(
            decisions=[decision_to_proto(d) for d in log.recent(request.limit, request.model)],
            capacity=log.capacity,
            recorded_total=log.recorded,
        )

    async def GetStats(self, request, context) -> admin_pb2.GetStatsResponse:
        ledger = self.picker.ledger
        per_instance = [
            admin_pb2.InstanceWorkload(
                instance_id=s.info.instance_id,
                workload_tokens=ledger.tokens(s.info.instance_id),
                inflight_requests=ledger.requests(s.info.instance_id),
                prefill_tokens=ledger.prefill_tokens(s.info.instance_id),
                decode_tokens=ledger.decode_tokens(s.info.instance_id),
            )
            for s in self.picker.instances.all()
        ]
        tiers = [
            admin_pb2.TierStats(tenant=t, tier=tier, requests_routed=c[0], requests_rate_limited=c[1])
            for (t, tier), c in sorted(self.counters.tiers.items())
        ]
        tenants = []
        if self.decider is not None:
            quotas = self.decider.quotas
            counters = quotas.counters
            tenants = [
                admin_pb2.TenantStats(
                    tenant=name,
                    requests_inflight=quotas.in_flight(name),
                    requests_admitted=counters.admitted.get(name, 0),
                    requests_rate_limited=counters.limited.get(name, 0),
                    tokens_refunded=counters.refunded_tokens.get(name, 0),
                )
                for name in sorted(self.decider.tenants.specs)
            ]
        return admin_pb2.GetStatsResponse(
            tiers=tiers,
            tenants=tenants,
            queues=self._queue_stats(),
            requests_routed=self.counters.routed,
            requests_rejected=self.counters.rejected,
            requests_inflight=ledger.total_requests,
            workload_tokens=ledger.total_tokens,
            policy=self.picker.policy.name,
            instances=per_instance,
            sizing=[sizing_to_proto(z) for z in (self.sizing() if self.sizing is not None else [])],
            ttft_slo=self._ttft_slo(),
        )


def _queue_stats_of(gate: FlowGate) -> list[admin_pb2.QueueStats]:
    """`Admin/GetStats`'s `queues`: every model's queue counters, per (tier, tenant)."""
    rows: dict[tuple[str, str], admin_pb2.QueueStats] = {}

    def row(tier: str, tenant: str) -> admin_pb2.QueueStats:
        stats = rows.get((tier, tenant))
        if stats is None:
            stats = rows[(tier, tenant)] = admin_pb2.QueueStats(tenant=tenant, tier=tier)
        return stats

    for (tier, tenant), n in gate.depth_by_tenant().items():
        row(tier, tenant).queued_now += n
    for queue in gate.queues.values():
        c = queue.counters
        for key, n in c.admitted.items():
            row(*key).admitted_at_once += n
        for key, n in c.queued.items():
            row(*key).queued += n
        for key, n in c.released.items():
            row(*key).released += n
        for key, s in c.wait_s.items():
            row(*key).released_wait_seconds += s
        for (tier, tenant, reason), n in c.shed.items():
            stats = row(tier, tenant)
            setattr(stats, f"shed_{reason}", getattr(stats, f"shed_{reason}") + n)
    return [rows[k] for k in sorted(rows)]


class MetaserverService(metaserver_pb2_grpc.MetaserverServicer):
    """Decode-first trigger callbacks (`concurrent_engine_sync`), reached through Envoy's JSON transcoding."""

    def __init__(self, trigger: TriggerCoordinator, replica: str) -> None:
        self.trigger = trigger
        self.replica = replica

    async def Trigger(
        self, request: metaserver_pb2.TriggerRequest, context
    ) -> metaserver_pb2.TriggerResponse:
        request_id_var.set(request.request_id)
        if request.replica and request.replica != self.replica:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"callback for coordinator {request.replica!r} reached {self.replica!r}; no attempt here",
            )
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        try:
            await self.trigger.callback(request)
        except UnknownAttempt as exc:
            metrics.CALLBACKS.labels("unknown").inc()
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except CallbackRefused as exc:
            metrics.CALLBACKS.labels("refused").inc()
            log.warning("metaserver callback refused", extra={"error": str(exc)})
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except PrefillLegFailed as exc:
            metrics.CALLBACKS.labels("failed").inc()
            log.warning("metaserver callback failed", extra={"error": str(exc)})
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except asyncio.CancelledError:
            # The decode engine gave up on this callback: the attempt stops (its prefill leg is cancelled).
            metrics.CALLBACKS.labels("cancelled").inc()
            with contextlib.suppress(UnknownAttempt):
                self.trigger.registry.close(self.trigger.registry.find(request.request_id))
            raise
        metrics.CALLBACKS.labels("ok").inc()
        return metaserver_pb2.TriggerResponse(status="ok")


def config_as_yaml(config) -> str:
    """The effective config as YAML (pydantic model dump), secrets redacted (`coordinator.redact`)."""
    return yaml.safe_dump(redact(config.model_dump(mode="json")), sort_keys=False)
