"""One routing decision per request, shared by both of Envoy's decision transports (`ext_proc.py`,
`ext_authz.py`): understand the body, pick, commit, issue the ticket, run the P/D preparation, and say what
Envoy must do. The transports only translate messages.

The checks of the OpenAI port live here too, so that both transports apply them (docs/security.md): the API key
(401 before anything else), the request limits and the prompt's size against the model's context (in
`understand_body`, inline or in a worker process), the engine-facing request id the coordinator mints (the
client's own id is only a label, echoed back), and the headers the engine must not get (the API key).

Tokenization stays off the event loop for large bodies: a body of more than `inline_bytes` is parsed and
tokenized in a worker process (`coordinator/understand_pool.py`), so one huge prompt does not stall the decisions
of the small ones behind it. Smaller bodies are decided inline, which costs no inter-process hop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from coordinator import metrics
from coordinator.adapter_loader import AdapterLoader
from coordinator.api_keys import ApiKeys
from coordinator.config import PdMode
from coordinator.errors import OpenAIError
from coordinator.flow_gate import OPEN, FlowGate
from coordinator.handoff import HandoffRunner
from coordinator.picker import EndpointPicker, Pick
from coordinator.quotas import Admission, Quotas, RateLimited, output_bound
from coordinator.relearn import RelearnWindow
from coordinator.request_ids import client_request_id, log_id, mint_request_id
from coordinator.routing_quality import prediction_of
from coordinator.tenants import ENGINE_PRIORITY, TenantSpec, TenantTable, resolve_tier
from coordinator.tickets import ABORTED, Ticket, TicketTable
from coordinator.trigger import TriggerCoordinator
from coordinator.understand_pool import UnderstandPool
from coordinator.understanding import ROUTED_PATHS
from tandem import tracing

log = logging.getLogger(__name__)

UNAUTHORIZED = OpenAIError(
    401, "Missing or incorrect API key: send `Authorization: Bearer <key>`.", code="invalid_api_key"
)
#: Request headers an engine never gets when the mesh checks API keys: the key is the mesh's, not the engine's.
API_KEY_HEADERS = ("authorization",)


@dataclass(slots=True)
class RequestCounters:
    """Requests this process routed or answered with an error since it started (for Admin.GetStats)."""

    routed: int = 0
    rejected: int = 0
    #: By (tenant, tier): [routed, rate limited]; tenant "" for none.
    tiers: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def tier(self, tenant: str, tier: str) -> list[int]:
        counts = self.tiers.get((tenant, tier))
        if counts is None:
            counts = self.tiers[(tenant, tier)] = [0, 0]
        return counts


@dataclass(slots=True, frozen=True)
class RequestIds:
    """A request's ids: the one the coordinator minted (engines, attempts, callbacks and tickets are keyed by it,
    so two requests with the same client id never meet inside the mesh) and the client's, a label only."""

    engine: str
    client: str = ""  # the client's X-Request-Id, cut to printable ASCII (`request_ids.client_request_id`)

    @property
    def echo(self) -> str:
        """The id the client gets back (`x-tandem-client-request-id`, which Envoy returns as `x-request-id`)."""
        return self.client or self.engine

    @property
    def log(self) -> str:
        return log_id(self.client, self.engine)


def new_request_ids(client_header: str | None) -> RequestIds:
    """Fresh ids for a request whose client sent `client_header` as its X-Request-Id (Envoy generates one when the
    client sends none)."""
    return RequestIds(mint_request_id(), client_request_id(client_header))


@dataclass(slots=True)
class Routed:
    """What Envoy must do with a routed request."""

    destination: str  # `host:port` of the engine Envoy forwards to
    request_id: str  # the `X-Request-Id` the engine gets (minted; trigger mode numbers its attempts)
    client_request_id: str  # set as `x-tandem-client-request-id`, echoed to the client as its `x-request-id`
    ticket: Ticket  # released when Envoy logs the request's end
    body: bytes | None = None  # the body the engine gets instead of the client's (P/D modes)
    # Request headers the engine must not get: ext_authz removes them on this word; the ext_proc routes remove
    # the same ones themselves (see ext_proc.py).
    remove_headers: tuple[str, ...] = ()
    fallback: str | None = None  # a second engine Envoy may retry on (the destination header lists both)
    tier: str = "default"  # the service tier it is served in (`coordinator/tenants.py`)
    tenant: str = ""  # its tenant's name; "" for none
    #: Headers the client gets with the engine's reply: its tenant's `x-ratelimit-*` (`coordinator/quotas.py`).
    response_headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class Answer:
    """A response the coordinator gives instead of routing (errors, `/v1/models`, health)."""

    status: int
    body: bytes
    details: str  # Envoy's response code details
    headers: list[tuple[str, str]] = field(
        default_factory=list
    )  # besides content-type (429: retry-after, ...)


def error_answer(error: OpenAIError) -> Answer:
    return Answer(error.status, error.body(), f"tandem_{error.status}", list(getattr(error, "headers", ())))


def models_listing(models: list[str], adapters: dict[str, str], created: int) -> list[dict]:
    """`/v1/models` entries as vLLM lists them: each model with `parent` null, then each of its adapters (name ->
    base model) with `parent` its base model. Adapters of a model with no routable instance are left out, as the
    model is."""
    data: list[dict] = []
    for model in models:
        data.append(
            {"id": model, "object": "model", "created": created, "owned_by": "tandem", "parent": None}
        )
        for name in sorted(a for a, base in adapters.items() if base == model):
            data.append(
                {"id": name, "object": "model", "created": created, "owned_by": "tandem", "parent": model}
            )
    return data


class Decider:
    """Routes one request at a time; see the module doc."""

    def __init__(
        self,
        picker: EndpointPicker,
        handoff: HandoffRunner,
        trigger: TriggerCoordinator,
        tickets: TicketTable,
        pool: UnderstandPool | None = None,
        inline_bytes: int = 8192,
        api_keys: ApiKeys | None = None,
        tenants: TenantTable | None = None,
        engine_priority: bool = False,
    ) -> None:
        self.picker = picker
        self.api_keys = api_keys or ApiKeys()  # none (and no tenant): the OpenAI port is open
        #: Tenants by API key; replaced whole when the tenants file changes (`coordinator/tenants_watch.py`).
        self.tenants = tenants or TenantTable()
        #: Engines take vLLM's `priority` field (`coordinator.engine_priority`).
        self.engine_priority = engine_priority
        #: The tenants' quota state (per replica).
        self.quotas = Quotas()
        #: How late a request's end reaches this coordinator after its client got the answer (Envoy's access-log
        #: flush interval plus delivery, `MeshConfig.request_end_lag_s`): a tenant's request that finds all its
        #: requests in flight first waits this long for one to end, so that a client sending its next request as
        #: soon as it has the answer is not refused for the one that just ended.
        self.end_lag_s = 0.0
        self._ended = asyncio.Event()  # set, and replaced, whenever a tenant's request ends
        self.handoff = handoff
        self.trigger = trigger
        self.tickets = tickets
        self.inline_bytes = inline_bytes
        self.counters = RequestCounters()
        self._pool = pool
        #: SLO-aware admission (`coordinator.flow_control`): None when off.
        self.flow: FlowGate | None = None
        #: Loads a request's LoRA adapter onto the engine chosen for it when that engine lacks it
        #: (`coordinator.adapter_loader`); None: adapters are sent on as they are (the engine answers 404 if it
        #: does not serve one).
        self.loader: AdapterLoader | None = None
        self.relearn: RelearnWindow | None = (
            None  # after a start: wait for registrations rather than answer 503
        )

    async def _decide(
        self, api: str, raw_body: bytes, request_id: str, request, allowed: frozenset[str] | None = None
    ) -> Pick:
        """The picker's decision (among `allowed`, see `EndpointPicker.decide`); in the relearn window after a
        start, a 503 (no routable instance yet) waits for the next registration and is decided again."""
        while True:
            try:
                return await self.picker.decide(api, raw_body, request_id, request, allowed)
            except OpenAIError as exc:
                relearn = self.relearn
                if exc.status != 503 or relearn is None or not await relearn.wait_for_registration():
                    raise

    def without_body(self, method: str, path: str, authorization: str | None = None) -> Answer | None:
        """The answer to a request the coordinator does not route, or to one without a valid API key (401, on
        every `/v1/` path: health probes need no key); None for a routed path (which needs its body).
        `authorization`: the request's Authorization header, if any."""
        if path.startswith("/v1/") and not self._key_accepted(authorization):
            return self.reject(UNAUTHORIZED)
        api = ROUTED_PATHS.get(path)
        if api is not None:
            if method != "POST":
                return self.reject(OpenAIError(405, f"Use POST for {path}."))
            return None
        if path == "/v1/models" and method == "GET":
            data = models_listing(
                self.picker.instances.routable_models(), self.picker.adapters, int(time.time())
            )
            return Answer(200, json.dumps({"object": "list", "data": data}).encode(), "tandem_models")
        if path in ("/health", "/ping") and method == "GET":
            return Answer(200, b"", "tandem_health")
        return self.reject(OpenAIError(404, f"Tandem does not route {method} {path}."))

    @property
    def keys_required(self) -> bool:
        """Every `/v1/` request needs an API key (keys or tenants are configured)."""
        return self.api_keys.enabled or len(self.tenants) > 0

    def _key_accepted(self, authorization: str | None) -> bool:
        if not self.keys_required:
            return True
        if self.api_keys.enabled and self.api_keys.accepts(authorization):
            return True
        return self.tenants.tenant_of(authorization) is not None

    def reject(self, error: OpenAIError) -> Answer:
        self.counters.rejected += 1
        metrics.REJECTED.labels(str(error.status)).inc()
        log.info("rejected", extra={"status": error.status, "reason": error.message})
        return error_answer(error)

    async def route(
        self,
        path: str,
        raw_body: bytes,
        ids: RequestIds,
        extend: Callable[[], Awaitable[None]] | None = None,
        authorization: str | None = None,
        trace=None,
    ) -> Routed | Answer:
        """Decides where a POST to a routed `path` goes (its API key already checked by `without_body`). `extend`
        is awaited as a handoff prefill leg begins (the transport extends Envoy's timer if the reply turns out
        late); None means the transport cannot rewrite the body, so P/D modes are refused. `authorization`: the
        request's Authorization header (its tenant). `trace`: the parent span's context Envoy sent (traced
        requests only; `tandem.tracing`)."""
        if not tracing.ENABLED or trace is None or trace is tracing.UNSAMPLED:  # nothing of it is recorded
            return await self._route(path, raw_body, ids, extend, authorization)
        attributes = {
            "http.route": path,
            "tandem.request_id": ids.engine,
            "tandem.client_request_id": ids.echo,
        }
        with tracing.span("tandem.route", trace, attributes) as current:
            outcome = await self._route(path, raw_body, ids, extend, authorization)
            if isinstance(outcome, Routed):
                tracing.set_attributes(current, {"tandem.destination": outcome.destination})
            else:
                tracing.set_attributes(current, {"http.response.status_code": outcome.status})
            return outcome

    async def _route(
        self,
        path: str,
        raw_body: bytes,
        ids: RequestIds,
        extend: Callable[[], Awaitable[None]] | None,
        authorization: str | None,
    ) -> Routed | Answer:
        start = time.perf_counter()
        api = ROUTED_PATHS[path]
        request_id = ids.engine
        try:
            picker = self.picker
            pooled = len(raw_body) > self.inline_bytes and self._pool is not None
            with tracing.span("tandem.understand", attributes={"tandem.worker_process": pooled}) as current:
                if pooled:
                    assert self._pool is not None
                    request = await self._pool.understand(
                        api, raw_body, picker.instances.known_models, picker.max_model_len, picker.adapters
                    )
                else:
                    request = picker.understand(api, raw_body)
                tracing.set_attributes(
                    current, {"tandem.model": request.model, "tandem.prompt_tokens": request.prompt_tokens}
                )
            tenant = self.tenants.tenant_of(authorization)
            tier = resolve_tier(request.service_tier, tenant)
            if self.engine_priority:
                request.body["priority"] = ENGINE_PRIORITY[tier]
            admission = None
            if tenant is not None:  # 429 past its quota, before any work is committed
                try:
                    with tracing.span("tandem.admission", attributes={"tandem.tenant": tenant.name}):
                        await self._wait_for_a_place(tenant)
                        admission = self.quotas.admit(tenant, request.prompt_tokens, request.max_tokens)
                except RateLimited:
                    self.counters.tier(tenant.name, tier)[1] += 1
                    raise
            passed = OPEN
            try:
                if self.flow is not None:  # may wait for capacity, or refuse (429 `rejected: saturated`)
                    passed = await self.flow.admit(request, tier, tenant.name if tenant is not None else "")
                with tracing.span("tandem.pick") as current:
                    pick = await self._decide(api, raw_body, request_id, request, passed.allowed)
                    tracing.set_attributes(
                        current,
                        {
                            "tandem.mode": str(pick.mode),
                            "tandem.chosen": pick.target.instance.info.instance_id,
                        },
                    )
            except BaseException:
                if admission is not None:  # never served: nothing used
                    self.quotas.settle(admission, served=False)
                raise
            finally:
                passed.done()  # its workload is committed (or it failed): the queue's next head is checked
        except OpenAIError as exc:
            return self.reject(exc)
        except Exception:
            log.exception("routing failed")
            return self.reject(OpenAIError(500, "The coordinator failed to route this request; see its log."))
        ticket = self.tickets.issue([pick.target.commitment], request_id)
        if admission is not None:
            ticket.on_release = self._settle_on_release(admission, request.stream, request.max_tokens)
        if request.adapter and self.loader is not None:  # in flight until it ends: not unloaded under it
            self._count_adapter(ticket, pick.target.instance.info.instance_id, request.adapter)
        metrics.DECISION_SECONDS.observe(time.perf_counter() - start)
        engine_request_id = request_id
        body = None
        try:
            if pick.mode != PdMode.AGGREGATED and extend is None:
                self.tickets.abort(ticket)
                return self.reject(
                    OpenAIError(
                        503,
                        "P/D serving needs the ext_proc decision path (it rewrites the body); this mesh's Envoy "
                        "runs ext_authz. Set envoy.decision to ext_proc (or auto with P/D engines configured).",
                    )
                )
            adapter = pick.request.adapter
            # The chosen engine serves the request's adapter before the request is sent on.
            if adapter and self.loader is not None:
                if extend is not None and pick.mode != PdMode.HANDOFF:  # (a handoff extends for its own leg)
                    await extend()
                target = pick.target.instance.info.instance_id
                with tracing.span("tandem.adapter_load", attributes={"tandem.adapter": adapter}):
                    try:
                        await self.loader.ensure(pick.target.instance, adapter)
                    except OpenAIError as exc:
                        self.tickets.abort(ticket)
                        log.info("adapter not placed", extra={"instance": target, "adapter": adapter})
                        return self.reject(exc)
            if pick.mode == PdMode.AGGREGATED and self.engine_priority and extend is not None:
                body = json.dumps(request.body).encode()  # with the tier's `priority`
            elif pick.mode == PdMode.TRIGGER:
                with tracing.span("tandem.trigger_open"):
                    attempt, body = self.trigger.open(pick, path)
                registry = self.trigger.registry
                ticket.on_end = lambda: registry.close(attempt)  # the request's end ends the attempt
                engine_request_id = attempt.engine_request_id
            elif pick.mode == PdMode.HANDOFF:
                assert extend is not None
                await extend()  # Envoy waits for this reply while the prefill leg runs
                try:
                    with tracing.span("tandem.handoff"):
                        body = await self.handoff.run(pick, path)
                except OpenAIError as exc:
                    self.tickets.abort(ticket)
                    return self.reject(exc)
        except BaseException:  # cancelled (the request went away) or failed before the decision left
            self.tickets.abort(ticket)
            raise
        instance = pick.target.instance.info
        prediction = prediction_of(
            pick.request.model,
            instance.instance_id,
            pick.target.match,
            pick.request.prompt_tokens,
            pick.predicted_ttft_s,
            pick.request.stream,
            tier,
        )
        ticket.prediction = prediction
        metrics.routing_predicted(prediction)
        if pick.planned is not None:
            metrics.pd_choice(pick.request.model, pick.planned)
        self.counters.routed += 1
        self.counters.tier(tenant.name if tenant is not None else "", tier)[0] += 1
        metrics.routed(instance.instance_id)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("routed", extra={"instance": instance.instance_id, "mode": pick.mode})
        removed = API_KEY_HEADERS if self.keys_required else ()
        routed = Routed(instance.address, engine_request_id, ids.echo, ticket, body, removed, pick.fallback)
        routed.tier = tier
        routed.tenant = tenant.name if tenant is not None else ""
        if admission is not None:
            routed.response_headers = admission.headers
        return routed

    def _count_adapter(self, ticket: Ticket, instance_id: str, adapter: str) -> None:
        """Counts the request in flight for its adapter on its instance (what an unload drains) until its ticket
        is released, however it ends."""
        assert self.loader is not None
        holds = self.loader.holds
        holds.routed(instance_id, adapter, time.monotonic())
        before = ticket.on_release

        def release(t: Ticket) -> None:
            try:
                if before is not None:
                    before(t)
            finally:
                holds.ended(instance_id, adapter)

        ticket.on_release = release

    async def _wait_for_a_place(self, tenant: TenantSpec) -> None:
        """Waits up to `end_lag_s` while `tenant`'s requests in flight are at its limit (see `end_lag_s`)."""
        deadline = time.monotonic() + self.end_lag_s
        while self.quotas.full(tenant) and (left := deadline - time.monotonic()) > 0:
            try:
                async with asyncio.timeout(left):
                    await self._ended.wait()
            except TimeoutError:
                return

    def _settle_on_release(self, admission: Admission, stream: bool, max_tokens: int):
        """The ticket's release hook: the request ended, however; its quota is settled (see `Quotas.settle`)."""
        quotas = self.quotas

        def settle(ticket: Ticket) -> None:
            if ticket.ended == ABORTED:  # the decision never reached Envoy
                quotas.settle(admission, served=False)
            elif ticket.response_bytes is not None:
                quotas.settle(admission, output_bound(ticket.response_bytes, stream, max_tokens))
            else:  # expired or reconciled: its output is unknown, no correction
                quotas.settle(admission)
            ended, self._ended = self._ended, asyncio.Event()
            ended.set()

        return settle
