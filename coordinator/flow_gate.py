"""SLO-aware admission's shell around the pure core (`coordinator/flow_control.py`): holds a request's decision
while no engine can serve it within its tier's SLO, and lets it go as capacity frees.

A routed request passes `FlowGate.admit` after its quota and before the picker commits any workload. Admitted at
once, it goes on; held, its decision (ext_authz's `Check`, ext_proc's body reply) waits on an asyncio future, one
per request, in one `FlowQueue` per model (capacity is per model). `kick` re-checks the queues' heads and is called
whenever capacity may have freed: a request's end (its ticket's release), an engine's heartbeat (its progress and
load), and a released request's commitment (so that heads are let go one at a time, each against the load that
the previous one added). The queue's TTL is each waiter's own timer.

A client that leaves while its request waits (Envoy cancels the gRPC call, which cancels the handler) takes its
entry out of the queue: nothing was committed, its quota is given back by the decision path, and it counts
nowhere but in the `tandem_coordinator_queue_wait_seconds` it spent.

The capacity signal is each candidate's predicted TTFT and TPOT (`coordinator/latency.py`) from this replica's
ledger, raised to what the engine itself reports (requests waiting and running, in heartbeats): with coordinator
replicas, each replica queues the requests it decides, and sees the others' load through the engines' reports.
A candidate with nothing in flight always fits: holding a request cannot make an idle engine faster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from coordinator import metrics
from coordinator.config import FlowControlSettings, PdMode
from coordinator.errors import OpenAIError
from coordinator.flow_control import (
    DISPLACED,
    EXPIRED,
    Decision,
    EngineView,
    Entry,
    FlowQueue,
    Verdict,
    engines_meeting,
    fits,
    meeting,
    predict,
)
from coordinator.instances import InstanceState
from coordinator.picker import EndpointPicker
from coordinator.quotas import RateLimited
from coordinator.tenants import Tier
from coordinator.understanding import OpenAIRequest

log = logging.getLogger(__name__)

#: The message of every 429 the queue gives (its `retry-after` says when to try again).
SATURATED_MESSAGE = "rejected: saturated"


def saturated(decision: Decision) -> RateLimited:
    """The 429 of a refused request, OpenAI's RateLimitError shape with `retry-after`."""
    return RateLimited(SATURATED_MESSAGE, "requests", decision.retry_after_s, [])


@dataclass(slots=True, eq=False)
class _Waiter:
    future: asyncio.Future
    request: OpenAIRequest
    model: str


class Pass:
    """A request the gate let through; `done()` once its workload is committed (or it failed): the next head of
    its model's queue is then checked against the load it added. `allowed`: the instances predicted to meet its
    tier's threshold, where it should go (None: any)."""

    __slots__ = ("_gate", "_model", "_held", "allowed")

    def __init__(
        self, gate: FlowGate | None, model: str, held: bool, allowed: frozenset[str] | None = None
    ) -> None:
        self._gate, self._model, self._held = gate, model, held
        self.allowed = allowed

    def done(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None and self._held:
            gate._releasing[self._model] = max(0, gate._releasing.get(self._model, 0) - 1)
            gate.kick()


OPEN = Pass(None, "", False)


class FlowGate:
    """The queues of one coordinator replica; see the module doc."""

    def __init__(
        self,
        settings: FlowControlSettings,
        picker: EndpointPicker,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.picker = picker
        self.clock = clock
        self.queues: dict[str, FlowQueue] = {}
        self._waiters: dict[Entry, _Waiter] = {}
        self._releasing: dict[str, int] = {}  # released heads not yet committed, per model
        self._publish()

    def _queue(self, model: str) -> FlowQueue:
        q = self.queues.get(model)
        if q is None:
            s = self.settings
            q = self.queues[model] = FlowQueue(
                s.slos(),
                s.max_queued_total,
                s.quantum_tokens,
                s.max_retry_after_s,
                headroom=s.headroom,
                tpot_headroom=s.tpot_headroom,
            )
        return q

    # --- capacity --------------------------------------------------------------------------------------------

    def meeting(self, request: OpenAIRequest, tier: Tier, queue: FlowQueue) -> frozenset[str] | None:
        """The candidates of `request`'s model predicted (`flow_control.predict`) to meet `tier`'s threshold;
        None when the request fits anywhere: a candidate has nothing in flight (it fits whatever the SLO), none
        is routable (the picker answers 503), or P/D serving meets it (its prediction is the pools', the best
        prefill instance's TTFT and the best decode instance's TPOT, and the P/D policies choose)."""
        picker = self.picker
        try:
            mode = picker.mode_of(request.model)
        except OpenAIError:
            return None
        serving = [s for s in picker.instances.serving(request.model) if s.routable]
        if mode == PdMode.AGGREGATED:
            first = last = [s for s in serving if s.info.role == "hybrid"]
        else:
            last = [s for s in serving if s.info.role == "decode"]
            first = [s for s in serving if s.info.role == "prefill"] or last
        if not first or not last:
            return None
        isl, budget, threshold = request.prompt_tokens, picker.latency.budget, queue.threshold(tier)
        first_views = [self._view(s) for s in first]
        if first is last:
            met = engines_meeting(first_views, isl, budget, threshold)
            return None if met is None else frozenset(first[i].info.instance_id for i in met)
        ttft = min(predict(v, isl, budget)[0] for v in first_views)
        tpot = min(predict(self._view(s), isl, budget)[1] for s in last)
        return None if meeting([(ttft, tpot)], threshold) else frozenset()

    def _view(self, state: InstanceState) -> EngineView:
        ledger, iid = self.picker.ledger, state.info.instance_id
        decoding, context = ledger.decoding(iid)
        return EngineView(
            self.picker.latency.costs(iid),
            ledger.prefill_tokens(iid),
            decoding,
            context,
            ledger.requests(iid),
            state.load.running,
            state.load.waiting,
            self.picker.latency.prefill_rate(iid),
        )

    # --- admission -------------------------------------------------------------------------------------------

    async def admit(self, request: OpenAIRequest, tier: Tier, tenant: str) -> Pass:
        """Returns when `request` may go to an engine (a `Pass` to close once its workload is committed); raises
        `RateLimited` (429 `rejected: saturated`) when it is refused; cancelled, leaves no trace."""
        model = request.model
        queue = self._queue(model)
        now = self.clock()
        entry = Entry(None, tier, tenant, request.prompt_tokens + request.max_tokens, now)
        met = self.meeting(request, tier, queue) if not self._releasing.get(model, 0) else frozenset()
        decision = queue.offer(entry, fits(met), now)
        if decision.displaced is not None:
            self._refuse(decision.displaced, queue)
        if decision.verdict == Verdict.ADMIT:
            return OPEN if met is None else Pass(None, model, False, met)
        if decision.verdict == Verdict.REJECT:
            self._shed(entry, decision.reason)
            raise saturated(decision)
        future = asyncio.get_running_loop().create_future()
        self._waiters[entry] = _Waiter(future, request, model)
        self._publish()
        passed: Pass | None = None
        try:
            try:
                async with asyncio.timeout(entry.deadline - now):
                    await future
            except TimeoutError:
                # Not released (the timeout cancelled the future; a `kick` meanwhile may have taken the entry out).
                if not future.done() or future.cancelled():
                    expired = queue.expire(entry)
                    self._observe_wait(entry)
                    if expired.verdict == Verdict.ADMIT:
                        log.info(
                            "admitted past the queue's TTL", extra={"tier": tier.value, "tenant": tenant}
                        )
                        return OPEN
                    self._shed(entry, EXPIRED)
                    raise saturated(expired) from None
                # released as the timer fired: it goes on
            # Released (a displaced entry's future raised its 429 above), to the instances that met it then.
            passed = Pass(self, model, True, future.result())
            return passed
        finally:
            self._waiters.pop(entry, None)
            if queue.remove(entry):  # cancelled: the client left
                self._observe_wait(entry)
            if passed is None and future.done() and not future.cancelled() and future.exception() is None:
                # Released, but the request does not go on (its client left): the release is given back.
                self._releasing[model] = max(0, self._releasing.get(model, 0) - 1)
            self._publish()
            self.kick()

    def kick(self) -> None:
        """Capacity may have freed: lets go the heads that fit now (one per model until it is committed)."""
        if not self._waiters:
            return
        now = self.clock()
        for model, queue in self.queues.items():
            while not self._releasing.get(model, 0) and (head := queue.head()) is not None:
                waiter = self._waiters.get(head)
                if waiter is None or waiter.future.done():  # leaving already
                    queue.remove(head)
                    continue
                met = self.meeting(waiter.request, head.tier, queue)
                if fits(met):
                    queue.release(head, now)
                    self._observe_wait(head)
                    self._releasing[model] = self._releasing.get(model, 0) + 1
                    waiter.future.set_result(met)
                break
        self._publish()

    # --- what it did -----------------------------------------------------------------------------------------

    def _refuse(self, entry: Entry, queue: FlowQueue) -> None:
        """A waiting entry displaced by a higher tier's: its waiter gets the 429."""
        waiter = self._waiters.get(entry)
        self._observe_wait(entry)
        self._shed(entry, DISPLACED)
        if waiter is not None and not waiter.future.done():
            retry = queue.retry_after_s(entry.tier, entry.tokens)
            waiter.future.set_exception(saturated(Decision(Verdict.REJECT, DISPLACED, retry)))

    def _shed(self, entry: Entry, reason: str) -> None:
        metrics.SHED.labels(entry.tier.value, entry.tenant, reason).inc()
        log.info(
            "rejected: saturated", extra={"tier": entry.tier.value, "tenant": entry.tenant, "reason": reason}
        )

    def _observe_wait(self, entry: Entry) -> None:
        metrics.QUEUE_WAIT_SECONDS.labels(entry.tier.value, entry.tenant).observe(
            max(0.0, self.clock() - entry.queued_at)
        )

    def _publish(self) -> None:
        for tier in Tier:
            metrics.QUEUE_DEPTH.labels(tier.value).set(sum(q.depth(tier) for q in self.queues.values()))

    def depth_by_tenant(self) -> dict[tuple[str, str], int]:
        """Waiting requests per (tier, tenant), over every model's queue."""
        out: dict[tuple[str, str], int] = {}
        for queue in self.queues.values():
            for tier in Tier:
                for tenant, n in queue.depth_by_tenant(tier).items():
                    out[(tier.value, tenant)] = out.get((tier.value, tenant), 0) + n
        return out
