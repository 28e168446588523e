"""The engine loop: schedule a step, let the timing model's duration pass (divided by the speedup), apply it,
hand new tokens to the serving layer, publish KV events. Runs as one asyncio task.

When the loop falls behind wall-clock time (CPU-bound at high speedup) it runs several steps before yielding,
so each streaming response gets several tokens per wake-up: writes are batched, not dropped or slowed per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from simengine.block_hash import BlockHasher
from simengine.config import EngineConfig
from simengine.events import EventSink
from simengine.kv_cache_manager import KVCacheManager
from simengine.lora import LoraRegistry
from simengine.metrics import EngineMetrics
from simengine.profiles import PROFILES
from simengine.request import Request, Status
from simengine.sampler import Sampler
from simengine.scheduler import Scheduler

log = logging.getLogger("simengine.engine")

#: Longest stretch of steps without yielding to the event loop, seconds of wall time.
_MAX_BUSY_S = 0.002
#: How far the simulated clock may lag wall time before it is reset (no catch-up bursts after a stall).
_MAX_LAG_S = 0.05


class Engine:
    """Owns the scheduler, KV cache manager and timing; the serving layer adds and aborts requests."""

    def __init__(self, cfg: EngineConfig, sampler: Sampler, metrics: EngineMetrics, publisher=None) -> None:
        self.cfg = cfg
        self.profile = PROFILES[cfg.profile]
        self.speedup = cfg.speedup
        self.metrics = metrics
        self.publisher = publisher
        self.sink = EventSink(enabled=publisher is not None)
        self.kv = KVCacheManager(
            num_npu_blocks=cfg.npu_blocks,
            block_size=cfg.block_size,
            sink=self.sink,
            enable_caching=cfg.enable_prefix_caching,
            num_cpu_blocks=cfg.cpu_blocks,
            num_disk_blocks=cfg.disk_blocks,
            offload=cfg.offload,
            hasher=BlockHasher(cfg.prefix_caching_hash_algo, cfg.hash_seed),
        )
        #: The adapters this engine serves (`--enable-lora`), else None.
        self.lora: LoraRegistry | None = None
        if cfg.enable_lora:
            self.lora = LoraRegistry(
                cfg.served_model_names, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras
            )
            metrics.enable_lora(cfg.max_loras)
        self.scheduler = Scheduler(
            self.kv, sampler, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.scheduling_policy,
            cfg.max_loras if cfg.enable_lora else 0,
        )  # fmt: skip
        #: Adapter name -> ids of its requests that produced output and have not finished, in the order the
        #: adapters appeared (vLLM's `LoRARequestStates`, whose keys label `vllm:lora_requests_info`).
        self._lora_requests: dict[str, set[str]] = {}
        #: Called with the requests whose remote KV transfer must start (set by the P/D connector).
        self.on_remote_kv: Callable[[list[Request]], None] | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._queries = 0
        self._hits = 0
        self.steps = 0

    # -- serving-layer API ------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.metrics.num_requests_waiting.set(len(self.scheduler.waiting))
        self._wake.set()

    def _lora_done(self, request: Request) -> None:
        if request.lora is not None:
            ids = self._lora_requests.get(request.lora.name)
            if ids is not None:
                ids.discard(request.request_id)
                if not ids:
                    del self._lora_requests[request.lora.name]

    def abort(self, request: Request) -> None:
        self._lora_done(request)
        if not request.is_finished:
            self.scheduler.abort(request)
            self.metrics.success["abort"].inc()
            self._wake.set()

    def stop_request(self, request: Request, stop: str) -> None:
        """Ends a request whose text reached a stop string (the serving layer detects those, as vLLM's
        detokenizer does)."""
        request.finish_reason = "stop"
        request.stop_reason = stop
        self._lora_done(request)
        if not request.is_finished:
            self.scheduler.abort(request, Status.FINISHED_STOPPED)
            self.metrics.success["stop"].inc()
            self._finish_metrics(request, time.monotonic(), count_success=False)
            self._wake.set()

    def fail(self, request: Request, message: str) -> None:
        """Ends a request with an error (P/D timeouts); its output callback sees it finished."""
        if request.is_finished:
            return
        self._lora_done(request)
        self.scheduler.abort(request, Status.FINISHED_ERROR)
        request.finish_reason = "error"
        request.stop_reason = message
        self.metrics.success["error"].inc()
        if request.on_output is not None:
            request.on_output(request, [], True)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        # No reset marker at start: as vLLM, the first batch (seq 0) is the first real cache change.
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("engine loop died; /health answers 503", exc_info=task.exception())

    @property
    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self.publisher is not None:
            self.publisher.shutdown()

    # -- loop -------------------------------------------------------------------------------------------------

    def _publish(self) -> None:
        if self.sink.events:
            self.publisher.publish(self.sink.drain())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        profile = self.profile
        m = self.metrics
        vclock = loop.time()
        busy_since = vclock
        while True:
            if not sched.has_work:
                self._update_gauges()
                if self.publisher is not None:
                    self._publish()
                self._wake.clear()
                if sched.remote_waiting:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(0.05):
                            await self._wake.wait()
                else:
                    await self._wake.wait()
                vclock = busy_since = loop.time()
                continue
            out = sched.schedule()
            if sched.new_remote:
                started, sched.new_remote = sched.new_remote, []
                if self.on_remote_kv is not None:
                    self.on_remote_kv(started)
            if out.preempted:
                m.num_preemptions.inc(len(out.preempted))
            if out.is_empty:
                self._update_gauges()
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.01):
                        await self._wake.wait()
                vclock = busy_since = loop.time()
                continue
            dt = profile.step_s(
                out.prefill_chunks,
                out.num_decode,
                out.decode_context,
                out.load_tokens_cpu,
                out.load_tokens_disk,
            )
            if self.lora is not None:
                dt += self._lora_loads(out) * self.cfg.lora_load_ms / 1000
            vclock += dt / self.speedup
            now = loop.time()
            if vclock > now:
                await asyncio.sleep(vclock - now)
                busy_since = loop.time()
            else:
                if now - vclock > _MAX_LAG_S:
                    vclock = now
                if now - busy_since > _MAX_BUSY_S:
                    await asyncio.sleep(0)
                    busy_since = loop.time()
            now_s = time.monotonic()
            step_tokens = 0
            for req, n in out.scheduled:
                step_tokens += n
                if req.scheduled_time == 0.0:
                    req.scheduled_time = now_s
            m.iteration_tokens.observe(step_tokens)
            produced = sched.update(out)
            self.steps += 1
            self._deliver(produced)
            if self.lora is not None:  # as vLLM, whose stats update after every step sets it
                m.set_lora_info(",".join(self._lora_requests), time.time())
            if self.publisher is not None and self.sink.events:
                self._publish()
            if self.steps % 8 == 0:
                self._update_gauges()

    def _lora_loads(self, out) -> int:
        """Adapters of this step whose weights were evicted from memory (`--max-cpu-loras`) and are read again."""
        lora = self.lora
        assert lora is not None
        return sum(1 for req, _ in out.scheduled if req.lora is not None and lora.touch(req.lora))

    def _deliver(self, produced: list[Request]) -> None:
        now = time.monotonic()
        m = self.metrics
        if produced:
            m.generation_tokens.inc(len(produced))
        for req in produced:
            if req.first_token_time == 0.0:
                req.first_token_time = now
                m.ttft.observe(now - req.arrival_time)
                # As vLLM: a request's prompt is counted when its prefill is done (its first token), which is the
                # progress signal routers read; a request aborted before its first token is never counted.
                m.prompt_tokens.inc(req.num_prompt_tokens)
            else:
                m.itl.observe(now - req.last_token_time)
            req.last_token_time = now
            finished = req.is_finished
            if req.lora is not None:
                if finished:
                    self._lora_done(req)
                else:
                    self._lora_requests.setdefault(req.lora.name, set()).add(req.request_id)
            if finished:
                self._finish_metrics(req, now)
            cb = req.on_output
            if cb is not None:
                cb(req, req.output_token_ids[-1:], finished)

    def _finish_metrics(self, req: Request, now: float, count_success: bool = True) -> None:
        m = self.metrics
        if count_success:
            m.success[req.finish_reason or "stop"].inc()
        m.e2e.observe(now - req.arrival_time)
        n = len(req.output_token_ids)
        if n > 1:
            m.tpot.observe((now - req.first_token_time) / (n - 1))
        scheduled = req.scheduled_time or now
        first = req.first_token_time or now
        m.queue_time.observe(scheduled - req.arrival_time)
        m.prefill_time.observe(first - scheduled)
        m.decode_time.observe(now - first)
        m.inference_time.observe(now - scheduled)
        m.request_prompt_tokens.observe(req.num_prompt_tokens)
        m.request_generation_tokens.observe(n)
        m.request_max_num_generation_tokens.observe(req.params.max_tokens)
        m.request_params_max_tokens.observe(req.params.max_tokens)
        m.request_params_n.observe(1)
        m.request_num_preemptions.observe(req.num_preemptions)
        m.request_prefill_kv_computed_tokens.observe(
            max(req.num_prompt_tokens - max(req.num_cached_tokens, 0) - req.num_external_tokens, 0)
        )
        cached = max(req.num_cached_tokens, 0)
        m.prompt_tokens_cached.inc(cached + req.num_external_tokens)
        m.prompt_local_cache_hit.inc(cached)
        m.cached_by_source["device"].inc(cached)
        m.cached_by_source["external_unspecified"].inc(req.num_external_tokens)
        m.prompt_external_kv_transfer.inc(req.num_external_tokens)
        m.prompt_local_compute.inc(max(req.num_prompt_tokens - cached - req.num_external_tokens, 0))

    def _update_gauges(self) -> None:
        m = self.metrics
        sched = self.scheduler
        m.num_requests_running.set(len(sched.running))
        m.num_requests_waiting.set(len(sched.waiting) + len(sched.remote_waiting))
        deferred = min(sched.num_deferred, len(sched.waiting))  # skipped for an adapter slot last step
        m.waiting_capacity.set(len(sched.waiting) - deferred)
        m.waiting_deferred.set(len(sched.remote_waiting) + deferred)
        m.kv_cache_usage_perc.set(self.kv.usage())
        if self.lora is not None and self.steps:
            m.set_lora_info(",".join(self._lora_requests), time.time())
        kv = self.kv
        if kv.queries != self._queries:
            m.prefix_cache_queries.inc(kv.queries - self._queries)
            m.prefix_cache_hits.inc(kv.hits - self._hits)
            self._queries, self._hits = kv.queries, kv.hits
