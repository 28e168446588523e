"""Continuous-batching scheduler (vLLM v1's shape, trimmed): running requests first (decode or the rest of a
chunked prefill), then waiting ones while the token budget, `max_num_seqs` and the KV cache allow; when the
cache cannot grow a running request, the most recently admitted running request is preempted (its blocks freed,
recomputed later). Pure: the engine loop supplies time and I/O.

`policy` is vLLM's `--scheduling-policy`: `fcfs` (arrival order; a preempted request goes back to the front), or
`priority`, as vllm/v1/core/sched/request_queue.py (`PriorityRequestQueue`) and scheduler.py do it: the waiting
queue is ordered by (priority, arrival time), smaller first, a preempted request going back to its place in that
order; when the cache cannot grow a running request, the running request with the largest (priority, arrival
time) is preempted instead of the most recently admitted one."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from simengine.kv_cache_manager import KVCacheManager
from simengine.lora import may_schedule
from simengine.request import Request, Status
from simengine.sampler import Sampler


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work."""

    #: (request, tokens to compute this step) in batch order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    #: (new tokens, cached context) per prefill chunk, for the timing model.
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)
    num_decode: int = 0
    decode_context: int = 0
    load_tokens_cpu: int = 0
    load_tokens_disk: int = 0
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class StepStats:
    """Prompt tokens by source this step, as vLLM's `prompt_tokens_by_source` counts them."""

    local_compute: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0


class Scheduler:
    """Owns the waiting and running queues."""

    def __init__(
        self,
        kv: KVCacheManager,
        sampler: Sampler,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        max_loras: int = 0,
    ):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.kv = kv
        self.priority = policy == "priority"
        self.sampler = sampler
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: Blocks allocated, KV coming from a remote engine (P/D decode side).
        self.remote_waiting: list[Request] = []
        #: Requests that entered `remote_waiting` since the engine last looked (it starts their transfer).
        self.new_remote: list[Request] = []
        #: Finished requests whose blocks stay allocated until a remote engine took their KV (P/D prefill side).
        self.held: dict[str, Request] = {}
        self.num_preemptions = 0
        self.stats = StepStats()
        #: `--max-loras` (0: LoRA off): distinct adapters that may run in one step.
        self.max_loras = max_loras
        #: Waiting requests the last step skipped because their adapter found no slot (vLLM's "deferred").
        self.num_deferred = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or any(r.remote_kv_done for r in self.remote_waiting))

    def add_request(self, request: Request) -> None:
        if self.priority:
            self._insert(request)
        else:
            self.waiting.append(request)

    def _insert(self, request: Request) -> None:
        """Into the waiting queue at its (priority, arrival) place, after equals (priority policy)."""
        waiting = self.waiting
        key = (request.priority, request.arrival_time)
        index = bisect.bisect_right([(r.priority, r.arrival_time) for r in waiting], key)
        waiting.insert(index, request)

    def _requeue(self, request: Request) -> None:
        """Back into the waiting queue: at the front (fcfs), at its place (priority)."""
        if self.priority:
            self._insert(request)
        else:
            self.waiting.appendleft(request)

    def abort(self, request: Request, status: Status = Status.FINISHED_ABORTED) -> None:
        """Removes a request wherever it is and frees its blocks (idempotent)."""
        if request.is_finished and request.request_id not in self.held:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.remote_waiting:
            self.remote_waiting.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.held.pop(request.request_id, None)
        self.kv.free(request)

    def release_held(self, request_id: str) -> Request | None:
        """Frees the blocks of a finished request kept for a remote engine."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
        return request

    # -- scheduling -------------------------------------------------------------------------------------------

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = Status.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._requeue(victim)
        out.preempted.append(victim)

    def _admit_remote_done(self) -> None:
        for req in list(self.remote_waiting):
            if not req.remote_kv_done or len(self.running) >= self.max_num_seqs:
                continue
            self.remote_waiting.remove(req)
            if req.remote_kv_ok:
                # The delivered prefix is here; what is left (at least the last prompt token, whose logits give the
                # first output token) is computed locally.
                computed = min(max(req.num_computed_tokens, req.num_remote_tokens), req.num_prompt_tokens - 1)
                req.num_external_tokens = computed - req.num_computed_tokens
                self.stats.external_kv_transfer += req.num_external_tokens
                req.num_computed_tokens = computed
                req.needs_remote_kv = False  # a later preemption recomputes locally
                req.status = Status.RUNNING
                self.running.append(req)
            else:  # fall back to computing the prompt here
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.needs_remote_kv = False
                req.status = Status.WAITING
                self._requeue(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.remote_waiting:
            self._admit_remote_done()
        budget = self.max_num_batched_tokens
        kv = self.kv
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while not kv.allocate_slots(req, n):
                if self.priority:
                    victim = max(running, key=lambda r: (r.priority, r.arrival_time))
                    at = running.index(victim)
                    del running[at]
                    if at < i:  # scheduled earlier this step: undone, its budget given back (as vLLM does)
                        i -= 1
                        budget += self._unschedule(out, victim)
                else:
                    victim = running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._add(out, req, n)
                budget -= n
                i += 1
                continue
            break
        if out.preempted:
            return out
        waiting = self.waiting
        max_loras = self.max_loras
        active = {r.lora.int_id for r in running if r.lora is not None} if max_loras else set()
        #: Skipped for want of an adapter slot; back at the front of the queue, in order, after this step.
        skipped: list[Request] = []
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting[0]
            if max_loras and not may_schedule(active, req.lora, max_loras):
                skipped.append(waiting.popleft())
                continue
            computed = kv.get_computed_blocks(req)
            hit = computed.num_blocks * kv.block_size
            if req.needs_remote_kv:
                if not kv.allocate_slots(req, req.num_tokens - hit, computed):
                    break
                kv.record_prefix_cache_stats(req, hit)
                waiting.popleft()
                if (
                    req.num_cached_tokens < 0
                ):  # as vLLM: the hit when scheduled, not at an attempt that waited
                    req.num_cached_tokens = hit
                self.stats.local_cache_hit += hit
                req.status = Status.WAITING_FOR_REMOTE_KVS
                self.remote_waiting.append(req)
                self.new_remote.append(req)
                continue
            n = min(req.num_tokens - hit, budget)
            if not kv.allocate_slots(req, n, computed):
                break
            kv.record_prefix_cache_stats(req, hit)
            waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit
            if req.num_preemptions == 0 or req.status != Status.PREEMPTED:
                self.stats.local_cache_hit += hit
            req.status = Status.RUNNING
            running.append(req)
            if req.lora is not None:
                active.add(req.lora.int_id)
            self._add(out, req, n)
            budget -= n
        if skipped:
            waiting.extendleft(reversed(skipped))
        self.num_deferred = len(skipped)
        return out

    def _unschedule(self, out: SchedulerOutput, req: Request) -> int:
        """Takes `req` out of this step's batch (preempted after it was scheduled); the tokens it had."""
        for k, (r, n) in enumerate(out.scheduled):
            if r is req:
                del out.scheduled[k]
                ctx = req.num_computed_tokens
                if n == 1 and req.output_token_ids and ctx == req.num_tokens - 1:
                    out.num_decode -= 1
                    out.decode_context -= ctx
                elif (n, ctx) in out.prefill_chunks:
                    out.prefill_chunks.remove((n, ctx))
                return n
        return 0

    def _add(self, out: SchedulerOutput, req: Request, n: int) -> None:
        out.scheduled.append((req, n))
        ctx = req.num_computed_tokens
        if n == 1 and req.output_token_ids and ctx == req.num_tokens - 1:
            out.num_decode += 1
            out.decode_context += ctx
        else:
            out.prefill_chunks.append((n, ctx))
            if ctx < req.num_prompt_tokens:
                self.stats.local_compute += min(n, req.num_prompt_tokens - ctx)
        if req.load_tokens_cpu or req.load_tokens_disk:
            out.load_tokens_cpu += req.load_tokens_cpu
            out.load_tokens_disk += req.load_tokens_disk

    # -- results ----------------------------------------------------------------------------------------------

    def update(self, out: SchedulerOutput) -> list[Request]:
        """Applies a finished step: advances computed tokens, caches full blocks, samples one token for each
        request whose known tokens are all computed, finishes requests. Returns requests with new output."""
        produced: list[Request] = []
        finished = False
        kv = self.kv
        sampler = self.sampler
        for req, n in out.scheduled:
            if req.status is not Status.RUNNING:
                continue  # aborted during the step
            req.num_computed_tokens += n + req.load_tokens_cpu + req.load_tokens_disk
            req.load_tokens_cpu = req.load_tokens_disk = 0
            kv.cache_blocks(req, req.num_computed_tokens)
            if req.num_computed_tokens < req.num_tokens:
                continue
            tok = sampler.next_token(req)
            req.output_token_ids.append(tok)
            p = req.params
            if tok == sampler.eos and not p.ignore_eos and len(req.output_token_ids) > p.min_tokens:
                req.status = Status.FINISHED_STOPPED
                req.finish_reason = "stop"
            elif len(req.output_token_ids) >= p.max_tokens:
                req.status = Status.FINISHED_LENGTH
                req.finish_reason = "length"
            if req.status is not Status.RUNNING:
                finished = True
                if req.hold_blocks_for_remote:
                    self.held[req.request_id] = req
                else:
                    kv.free(req)
            produced.append(req)
        if finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        return produced
