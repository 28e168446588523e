"""The peers' admission (flow control) in the overload simulation, as rows next to Tandem's: each is a small
`bench.fleet.overload.Admission` that reproduces the *behaviour* of its system's rule, as read in its source (no
code copied), with the defaults as shipped, fed the signals that system really uses. Routing is the same for every
row (`least_load` on the coordinator's ledger), so the rows differ in admission only.

llm-d (repository llm-d/llm-d-inference-scheduler, the endpoint picker that moved there from
kubernetes-sigs/gateway-api-inference-extension after v1.5.0; read at commit 520af47, 2026-05-17):

- Saturation (`pkg/epp/framework/plugins/flowcontrol/saturationdetector/utilization/detector.go`, `config.go`):
  per endpoint `max(waiting / queueDepthThreshold, kv_cache_usage / kvCacheUtilThreshold)`, an endpoint whose
  metrics are older than `metricsStalenessThreshold` counting 1.0; the pool's saturation is the mean over
  endpoints. Defaults 5 requests, 0.8, 200 ms. The metrics are the engines' `/metrics`
  (`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`) scraped every 50 ms (`--refresh-metrics-interval`).
- As shipped (`pkg/epp/requestcontrol/admission.go`, `LegacyAdmissionController`; flow control is behind a
  feature gate, `cmd/epp/runner/runner.go`): a *sheddable* request (priority < 0,
  `pkg/epp/util/request/sheddable.go`) is refused with 429 (`ResourceExhausted`) when saturation >= 1.0; every
  other request goes at once. Here `priority` is priority 0 and `flex` is -1 (sheddable).
- Flow control (the feature gate on; `pkg/epp/flowcontrol/controller/internal/processor.go`,
  `registry/config.go`, `controller/config.go`, `usagelimits/usagelimitpolicy.go`): every request waits in its
  priority band's queue; a dispatch cycle runs on each arrival and on a 1 ms ticker and sends one request: the
  highest band's head (fairness `global-strict`, ordering `fcfs`), unless saturation >= the band's usage limit
  (static policy: 1.0 for every band), in which case nothing is sent (head-of-line blocking across all bands).
  Defaults: no request TTL (`DefaultRequestTTL` 0: a request waits until its client leaves), band capacity 1 GB;
  a full band answers 429, an expired request 503. The pool's metrics are the same 50 ms scrape (candidates are
  cached 50 ms).
- Predicted latency (`pkg/epp/framework/plugins/requestcontrol/admitter/latencyslo`, with the
  `predicted-latency-producer` and `scheduling/scorer/latency`): a sheddable request is refused unless some
  endpoint is predicted to meet its TTFT and TPOT SLOs, or has no request dispatched by the picker, or has < 2% KV
  usage; non-sheddable requests bypass it. Its predictions come from a trained latency-predictor sidecar (XGBoost
  on the picker's own observations), which the simulator has not got: the row uses Tandem's latency model
  (`coordinator.flow_control.predict`) in its place, so it shows the *rule*, with a predictor no worse than
  Tandem's. It is not enabled by default; its row runs on top of the shipped saturation shedding.

Dynamo (ai-dynamo/dynamo, read in the code index at `lib/llm/src/discovery/worker_monitor.rs` commit 0022077,
`lib/kv-router/src/scheduling/policy_config.rs` commit 0111b61, `lib/kv-router/src/scheduling/config.rs` commit
0243c51, and the request-rejection guide of docs v1.3.0):

- Busy rejection (`worker_monitor.rs`, `LoadThresholdConfig`): a worker is overloaded when its active prefill
  tokens exceed `--active-prefill-tokens-threshold` (or a fraction of `max_num_batched_tokens`), or its KV blocks
  (the router's active decode blocks, or the engine's used blocks) exceed `--active-decode-blocks-threshold` of its
  total; overloaded workers are left out of routing, and when *every* worker is, the request is refused: HTTP 529
  since v1.3.0 (503 before). Every threshold is off by default (`None`): as shipped, Dynamo never refuses. The
  `documented` row uses the guide's example values (0.85 and 10,000 tokens), not a tuning of ours.
- Router queue (`policy_config.rs`, `PolicyProfile::synthetic`, `worker_is_busy`, `pool_is_busy`): without a
  policy file there is one class, `default`, whose busy threshold is `--router-queue-threshold` as a fraction of
  `max_num_batched_tokens`: while *every* worker's active prefill tokens exceed it, requests wait in the router,
  FCFS with the `strict_priority` hint first (here `priority` sends strict priority 1); they leave as workers stop
  being busy. The default differs between the versions stored: `KvRouterConfig::default` has 4.0 (with a test
  `test_default_is_4_0`), one frontend argument file 16.0, another none (queueing off); the rows use 4.0 (with
  16.0 or none the queue never fills here and the row is "off").
- Policy classes (DRR across classes, `queue_admission/`, docs "Deficit Round Robin Queue Scheduling"): only with a
  policy file (`--router-policy-config`); no file ships, and quanta per class would be our tuning, so no row. With
  the single synthetic class, DRR is FCFS.
- Signals: Dynamo's router is in the token path: its active prefill tokens leave at the first token, its active
  blocks at the end (output blocks not tracked, `router_track_output_blocks` false).
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from bench.fleet.overload import Admission, TrafficClass
from coordinator.flow_control import predict
from coordinator.tenants import Tier

# --- llm-d -----------------------------------------------------------------------------------------------------

#: llm-d's utilization detector defaults (`utilization/config.go`).
LLMD_QUEUE_DEPTH_THRESHOLD = 5
LLMD_KV_UTIL_THRESHOLD = 0.8
LLMD_STALENESS_S = 0.2
#: The endpoint picker's metrics refresh (`--refresh-metrics-interval`) and the flow controller's dispatch ticker.
LLMD_SCRAPE_S = 0.05
LLMD_TICK_S = 0.001
#: Cold endpoint for the latency-SLO admitter: KV usage below this counts as "predictions unreliable".
LLMD_COLD_KV = 0.02

#: InferenceObjective priority per tier: flex is sheddable (< 0).
LLMD_PRIORITY = {Tier.PRIORITY: 0, Tier.DEFAULT: 0, Tier.FLEX: -1}


def llmd_saturation(metrics: list[tuple[int, float, float]], now: float) -> float:
    """The pool's saturation from each endpoint's scraped (waiting, kv usage, scraped at)."""
    if not metrics:
        return 1.0
    total = 0.0
    for waiting, kv, at in metrics:
        if now - at > LLMD_STALENESS_S:
            total += 1.0
            continue
        total += max(waiting / LLMD_QUEUE_DEPTH_THRESHOLD, kv / LLMD_KV_UTIL_THRESHOLD)
    return total / len(metrics)


class _LlmDScrape(Admission):
    """The endpoint picker's view: every endpoint's waiting count and KV usage, scraped every 50 ms."""

    def bind(self, fleet) -> None:
        super().bind(fleet)
        self.metrics = [(0, 0.0, 0.0) for _ in fleet.instances]
        fleet.at(0.0, self._scrape)

    def _scrape(self) -> None:
        fleet = self.fleet
        self.metrics = [
            (len(i.scheduler.waiting) + len(i.scheduler.remote_waiting), i.kv.usage(), fleet.now)
            for i in fleet.instances
        ]
        self.scraped()
        if fleet.active:
            fleet.at(fleet.now + LLMD_SCRAPE_S, self._scrape)

    def scraped(self) -> None:
        pass

    def saturation(self) -> float:
        return llmd_saturation(self.metrics, self.fleet.now)


class LlmDShipped(_LlmDScrape):
    """llm-d as shipped: sheddable requests refused (429) while the pool is saturated; the rest go at once."""

    label = "llm-d (as shipped: shed sheddable)"

    def offer(self, arrived: float, c: TrafficClass) -> None:
        if LLMD_PRIORITY[c.tier] < 0 and self.saturation() >= 1.0:
            self.fleet.refuse(c, arrived)
            return
        self.fleet.dispatch(arrived, c)


class LlmDFlowControl(_LlmDScrape):
    """llm-d's flow control: priority bands, FCFS within a band, nothing sent while the pool is saturated."""

    label = "llm-d flow control"
    holds = True

    def __init__(self) -> None:
        self._bands: dict[int, deque[tuple[float, TrafficClass]]] = {}
        self._ticking = False

    def pending(self) -> int:
        return sum(len(b) for b in self._bands.values())

    def offer(self, arrived: float, c: TrafficClass) -> None:
        self._bands.setdefault(LLMD_PRIORITY[c.tier], deque()).append((arrived, c))
        fleet = self.fleet
        fleet.result.queue_peak = max(fleet.result.queue_peak, self.pending())
        self._cycle()  # a cycle runs as an item arrives
        self._tick_soon()

    def _cycle(self) -> bool:
        """One dispatch cycle: the highest band's head, unless saturated (then nothing, for every band)."""
        if self.saturation() >= 1.0:
            return False
        for priority in sorted(self._bands, reverse=True):
            band = self._bands[priority]
            if band:
                arrived, c = band.popleft()
                self.fleet.dispatch(arrived, c)
                return True
        return False

    def _tick_soon(self) -> None:
        if not self._ticking and self.pending():
            self._ticking = True
            self.fleet.at(self.fleet.now + LLMD_TICK_S, self._tick)

    def _tick(self) -> None:
        # The 1 ms ticker. Saturation changes only with a scrape, so a saturated pool waits for the next one
        # (`scraped`) instead of ticking through the interval.
        self._ticking = False
        if self._cycle():
            self._tick_soon()

    def scraped(self) -> None:
        self._tick_soon()


class LlmDLatencySlo(LlmDShipped):
    """llm-d's latency-SLO admitter on top of the shipped shedding (predictions: Tandem's model, see the module
    doc): a sheddable request needs an endpoint predicted to meet its SLO, or one with nothing dispatched, or one
    whose KV usage is below 2%."""

    label = "llm-d + latency-SLO admitter"

    def bind(self, fleet) -> None:
        super().bind(fleet)
        self._dispatched = [0] * len(fleet.instances)
        self._where: dict[int, int] = {}

    def on_dispatched(self, key: int, instance: int, c: TrafficClass) -> None:
        self._dispatched[instance] += 1
        self._where[key] = instance

    def on_end(self, key: int) -> None:
        self._dispatched[self._where.pop(key)] -= 1

    def offer(self, arrived: float, c: TrafficClass) -> None:
        if LLMD_PRIORITY[c.tier] < 0:
            fleet = self.fleet
            slo = fleet.cfg.slos[c.tier]
            budget = fleet.cfg.engine.max_num_batched_tokens
            valid = any(
                ttft <= slo.ttft_slo_s and tpot <= slo.tpot_slo_s
                for ttft, tpot in (predict(v, c.prompt, budget) for v in fleet.views())
            )
            idle = any(n == 0 for n in self._dispatched)
            cold = any(kv < LLMD_COLD_KV for _, kv, _ in self.metrics)
            if not (valid or idle or cold):
                fleet.refuse(c, arrived)
                return
        super().offer(arrived, c)


# --- Dynamo ----------------------------------------------------------------------------------------------------

#: `--router-queue-threshold`: `KvRouterConfig::default` (see the module doc for the versions' differences).
DYNAMO_QUEUE_THRESHOLD = 4.0
#: The request-rejection guide's example thresholds (all off by default).
DYNAMO_DOC_DECODE_BLOCKS = 0.85
DYNAMO_DOC_PREFILL_TOKENS = 10_000
#: `strict_priority` hint per tier (higher first).
DYNAMO_STRICT_PRIORITY = {Tier.PRIORITY: 1, Tier.DEFAULT: 0, Tier.FLEX: 0}


class Dynamo(Admission):
    """Dynamo's router: its own active prefill tokens and blocks per worker; the router queue (threshold 4.0 of
    `max_num_batched_tokens`, every worker busy) and, when configured, busy rejection (529)."""

    def __init__(
        self,
        prefill_tokens_threshold: int | None = None,
        decode_blocks_threshold: float | None = None,
        queue_threshold: float | None = DYNAMO_QUEUE_THRESHOLD,
    ) -> None:
        self.prefill_tokens_threshold = prefill_tokens_threshold
        self.decode_blocks_threshold = decode_blocks_threshold
        self.queue_threshold = queue_threshold
        self.holds = queue_threshold is not None
        rejects = prefill_tokens_threshold is not None or decode_blocks_threshold is not None
        self.label = "Dynamo (documented busy thresholds)" if rejects else "Dynamo (as shipped)"
        self._queue: list[
            tuple[int, int, float, TrafficClass]
        ] = []  # (-strict priority, seq, arrived, class)
        self._seq = 0

    def bind(self, fleet) -> None:
        super().bind(fleet)
        n = len(fleet.instances)
        self.prefill = [0] * n  # active prefill tokens: dispatched, first token not yet seen
        self.blocks = [0] * n  # active blocks: prompt blocks of requests in flight
        self._req: dict[
            int, tuple[int, int, int]
        ] = {}  # key -> (worker, prompt tokens, blocks); prompt 0 = done
        spec = fleet.cfg.engine
        self.block_size = spec.block_size
        self.total_blocks = spec.npu_blocks
        self.budget = spec.max_num_batched_tokens

    def pending(self) -> int:
        return len(self._queue)

    # -- its signals --

    def on_dispatched(self, key: int, instance: int, c: TrafficClass) -> None:
        blocks = math.ceil(c.prompt / self.block_size)
        self.prefill[instance] += c.prompt
        self.blocks[instance] += blocks
        self._req[key] = (instance, c.prompt, blocks)

    def on_first_token(self, key: int) -> None:
        worker, prompt, blocks = self._req[key]
        self.prefill[worker] -= prompt
        self._req[key] = (worker, 0, blocks)
        self._drain()

    def on_end(self, key: int) -> None:
        worker, prompt, blocks = self._req.pop(key)
        self.prefill[worker] -= prompt
        self.blocks[worker] -= blocks
        self._drain()

    # -- its rules --

    def overloaded(self, worker: int) -> bool:
        if self.prefill_tokens_threshold is not None and self.prefill[worker] > self.prefill_tokens_threshold:
            return True
        t = self.decode_blocks_threshold
        return t is not None and self.blocks[worker] > t * self.total_blocks

    def _queue_busy(self) -> bool:
        if self.queue_threshold is None:
            return False
        limit = self.queue_threshold * self.budget
        return all(p > limit for p in self.prefill)

    def offer(self, arrived: float, c: TrafficClass) -> None:
        if self._queue or self._queue_busy():
            heapq.heappush(self._queue, (-DYNAMO_STRICT_PRIORITY[c.tier], self._seq, arrived, c))
            self._seq += 1
            fleet = self.fleet
            fleet.result.queue_peak = max(fleet.result.queue_peak, len(self._queue))
            return
        self._send(arrived, c)

    def _send(self, arrived: float, c: TrafficClass) -> None:
        free = {w for w in range(len(self.prefill)) if not self.overloaded(w)}
        if not free:
            self.fleet.refuse(c, arrived)  # 529: all workers busy
            return
        self.fleet.dispatch(arrived, c, None if len(free) == len(self.prefill) else free)

    def _drain(self) -> None:
        while self._queue and not self._queue_busy():
            _, _, arrived, c = heapq.heappop(self._queue)
            self._send(arrived, c)


def peer_variants() -> list:
    """The peers' rows, as factories of fresh admissions (one per run)."""
    return [
        LlmDShipped,
        LlmDFlowControl,
        LlmDLatencySlo,
        Dynamo,
        lambda: Dynamo(DYNAMO_DOC_PREFILL_TOKENS, DYNAMO_DOC_DECODE_BLOCKS),
    ]
