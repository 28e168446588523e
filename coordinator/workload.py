"""Workload accounting in tokens per instance, following the engines' progress (pure core).

A request commits, on each instance it uses, the tokens of work it brings there:
- prefill tokens: prompt tokens the instance must compute, `ISL - matched_tokens` (cached prefix excluded);
- decode tokens: output tokens the instance will generate (`max_tokens` per prompt and choice);
- context tokens: prompt plus output tokens the instance holds KV for while the request runs (its KV footprint).
An aggregated request commits both on one instance; in P/D handoff the prefill leg commits prefill tokens on the
prefill instance and the decode leg commits decode tokens on the decode instance.

`release(commitment)` (the request ended: completed, failed or cut) takes back whatever is left of a commitment,
exactly once. Before that, the engines' progress takes work off the ledger as it is done:

- Prefill leaves when the request's prefill is done. vLLM's counter `vllm:prompt_tokens_total` grows by a
  request's prompt length when that request produces its first token; node agents relay it (per DP rank) a few
  times a second and `engine_progress` applies the growth to the instance's commitments in routing order
  (`prompt_tokens` is what each commitment adds to the counter). Growth that no commitment can absorb yet is kept
  as credit while commitments wait, and dropped when none does (traffic that did not pass through this
  coordinator never inflates the ledger).
- Between reports, an instance with a calibrated prefill rate (`set_prefill_rate`) drains its outstanding prefill
  at that rate from the last report (or from the moment it became busy): a time model re-anchored by the counter.
- Decode leaves as tokens are generated: the growth of `vllm:generation_tokens_total` is shared evenly among the
  instance's commitments whose prefill is done (continuous batching gives every running sequence one token per
  step), each capped at its own decode tokens.

Robustness: a counter that goes down (engine restart) counts from zero again, and commitments routed before the
previous report are taken as lost with the old process (their prefill leaves; their release still comes from their
completion). The first report of an instance (new instance, coordinator restart) only sets the baseline. A
commitment released before the counter accounted for it stays in the routing-order queue, as a marker, for
`marker_lifetime_s` (0.5 s: two reports of the node agent; its first token may still be counted in the next
report), unless its release says that it never started (then it leaves at once). The lifetime is short on purpose:
a request cut by its client before its first token is never counted, and while its marker waits at the head of
the queue it absorbs the count of the request behind it (measured: with 5% of requests cut, a 2 s lifetime left
the ledger at 2.5x the true queued prefill, 0.5 s at 1.2x, against 1.16x without cuts). Whatever the signal does, every commitment's remainder leaves at its release, so
the ledger cannot drift: it returns to zero whenever nothing is in flight.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from coordinator.latency import Interval


@dataclass(slots=True, eq=False)
class Commitment:
    """Tokens committed to one instance by one request leg; `released` guards against double release."""

    instance_id: str
    prefill_tokens: int
    decode_tokens: int
    context_tokens: int = 0
    released: bool = False
    #: What the leg adds to the engine's `vllm:prompt_tokens_total` when its prefill is done (its prompt length
    #: times its choices); 0 when progress is not tracked (the prefill then leaves at release or `prefill_done`).
    prompt_tokens: int = 0
    prefill_done: bool = False  # its prefill left the ledger (counter, first token, or engine restart)
    decode_done: int = 0  # decode tokens taken off as generated
    committed_at: float = 0.0
    released_at: float = 0.0
    started: bool | None = None  # from release(): False when the request is known to have produced no token

    @property
    def context_now(self) -> int:
        """Context (KV) tokens the leg holds now: its prompt plus the output generated so far."""
        return self.context_tokens - (self.decode_tokens - self.decode_done)


@dataclass(slots=True)
class _Progress:
    """One instance's progress state."""

    pending: collections.deque = field(default_factory=collections.deque)  # prefill not done, routing order
    decoding: dict = field(default_factory=dict)  # commitments whose prefill is done, decode left > 0
    seen: dict = field(default_factory=dict)  # dp rank -> (prompt counter, generation counter) last reported
    reported_at: float | None = None  # time of the last report applied
    credit: int = 0  # counter growth not yet matched to a commitment
    rate: float = 0.0  # calibrated prefill tokens per second (0: no time model)
    anchor: float = 0.0  # when the time model started draining the current outstanding prefill


class WorkloadLedger:
    """Tokens and requests in flight per instance. Counters return to zero when every commitment is released."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, marker_lifetime_s: float = 0.5) -> None:
        self.clock = clock
        self.marker_lifetime_s = marker_lifetime_s
        self._prefill: dict[str, int] = {}
        self._decode: dict[str, int] = {}
        self._context: dict[str, int] = {}
        self._requests: dict[str, int] = {}
        self._progress: dict[str, _Progress] = {}

    def _track(self, instance_id: str) -> _Progress:
        track = self._progress.get(instance_id)
        if track is None:
            track = self._progress[instance_id] = _Progress()
        return track

    # --- commitments -------------------------------------------------------------------------------------

    def commit(
        self,
        instance_id: str,
        prefill_tokens: int,
        decode_tokens: int,
        context_tokens: int = 0,
        prompt_tokens: int = 0,
    ) -> Commitment:
        """Adds the tokens (each >= 0) and one request to `instance_id`. With `prompt_tokens` > 0 (what the leg
        adds to the engine's prompt-token counter), its prefill leaves when the engine reports it done."""
        if min(prefill_tokens, decode_tokens, context_tokens, prompt_tokens) < 0:
            raise ValueError(
                f"cannot commit negative tokens ({prefill_tokens}, {decode_tokens}, {context_tokens}, "
                f"{prompt_tokens})"
            )
        now = self.clock()
        before = self._prefill.get(instance_id, 0)
        self._prefill[instance_id] = before + prefill_tokens
        self._decode[instance_id] = self._decode.get(instance_id, 0) + decode_tokens
        self._context[instance_id] = self._context.get(instance_id, 0) + context_tokens
        self._requests[instance_id] = self._requests.get(instance_id, 0) + 1
        c = Commitment(
            instance_id, prefill_tokens, decode_tokens, context_tokens, prompt_tokens=prompt_tokens
        )
        c.committed_at = now
        if prompt_tokens:
            track = self._track(instance_id)
            if before <= self._drained(track, before, now):  # idle until now: the time model starts here
                track.anchor = now
            track.pending.append(c)
        return c

    def release(self, commitment: Commitment, started: bool | None = None) -> bool:
        """Takes back what is left of a commitment; returns False (and changes nothing) when it was already
        released. `started=False` says the request ended before producing any token (so the engine will never
        count its prompt); None when unknown."""
        if commitment.released:
            return False
        c = commitment
        c.released = True
        c.released_at = self.clock()
        c.started = started
        iid = c.instance_id
        track = self._progress.get(iid)
        if track is not None:
            track.decoding.pop(id(c), None)
            if not c.prefill_done and c.prompt_tokens and started is False:
                _remove(track.pending, c)
        requests = self._requests[iid] - 1
        if requests == 0:
            # Drop idle entries so that the ledger does not grow with every instance ever seen.
            del self._prefill[iid], self._decode[iid], self._context[iid], self._requests[iid]
        else:
            self._requests[iid] = requests
            if not c.prefill_done:
                self._prefill[iid] -= c.prefill_tokens
            self._decode[iid] -= c.decode_tokens - c.decode_done
            self._context[iid] -= c.context_tokens
        return True

    def prefill_done(self, commitment: Commitment) -> bool:
        """The leg's prefill is done (first token seen, or the engine lost it): its prefill tokens leave now; the
        rest stays until release. False when already done or released."""
        c = commitment
        if c.prefill_done or c.released:
            return False
        c.prefill_done = True
        iid = c.instance_id
        self._prefill[iid] -= c.prefill_tokens
        track = self._progress.get(iid)
        if track is not None:
            if c.prompt_tokens:
                _remove(track.pending, c)
            if c.decode_tokens:
                track.decoding[id(c)] = c
        return True

    # --- engine progress ---------------------------------------------------------------------------------

    def set_prefill_rate(self, instance_id: str, tokens_per_s: float) -> None:
        """Calibrated prefill speed of an instance, for the time model between reports (0 turns it off)."""
        if tokens_per_s < 0:
            raise ValueError(f"prefill rate must be >= 0, got {tokens_per_s}")
        self._track(instance_id).rate = tokens_per_s

    def engine_progress(
        self, instance_id: str, counters: Mapping[int, tuple[float, float]]
    ) -> Interval | None:
        """Applies one report of an instance's counters: per DP rank, (`vllm:prompt_tokens_total`,
        `vllm:generation_tokens_total`). Returns what the instance did since its previous report (for the
        latency model, `coordinator.latency`), None for a first report or after a restart."""
        now = self.clock()
        track = self._track(instance_id)
        decoding_before = [c for c in track.decoding.values() if not c.released]
        prompt_growth = generation_growth = 0
        restarted = False
        for rank, (prompt, generation) in counters.items():
            prompt, generation = int(prompt), int(generation)
            last = track.seen.get(rank)
            track.seen[rank] = (prompt, generation)
            if last is None:
                continue  # first report of this rank: baseline only
            if prompt < last[0] or generation < last[1]:
                restarted = True  # counters reset: the engine restarted and counts from zero
                prompt_growth += prompt
                generation_growth += generation
            else:
                prompt_growth += prompt - last[0]
                generation_growth += generation - last[1]
        if restarted and track.reported_at is not None:
            lost = [c for c in track.pending if c.committed_at <= track.reported_at]
            for c in lost:
                self._leave_pending(track, c)
        self._expire_markers(track, now)
        computed, firsts = self._apply_prompt(track, prompt_growth) if prompt_growth else (0, 0)
        if generation_growth:
            self._apply_generation(track, generation_growth)
        since, track.reported_at = track.reported_at, now
        track.anchor = now
        if since is None or restarted:
            return None
        before = {id(c) for c in decoding_before}
        started = [c for c in track.decoding.values() if id(c) not in before]
        contexts = [c.context_now for c in decoding_before + started]
        return Interval(
            seconds=now - since,
            prefill_tokens=computed,
            generated=max(0, generation_growth - firsts),  # a leg's first token comes with its prefill
            decoding=len(decoding_before)
            + len(started) / 2,  # legs that started meanwhile decoded half of it
            mean_context=sum(contexts) / len(contexts) if contexts else 0.0,
        )

    def forget_progress(self, instance_id: str) -> None:
        """The instance was registered anew: its next report sets a new baseline."""
        track = self._progress.get(instance_id)
        if track is not None:
            track.seen.clear()
            track.credit = 0

    def _leave_pending(self, track: _Progress, c: Commitment) -> None:
        if c.released:
            _remove(track.pending, c)
        else:
            self.prefill_done(c)

    def _expire_markers(self, track: _Progress, now: float) -> None:
        limit = now - self.marker_lifetime_s
        if any(c.released and c.released_at < limit for c in track.pending):
            track.pending = collections.deque(
                c for c in track.pending if not (c.released and c.released_at < limit)
            )

    def _apply_prompt(self, track: _Progress, growth: int) -> tuple[int, int]:
        """Takes the prefill of legs the growth covers off, in routing order; returns their uncached tokens and
        how many legs they were."""
        credit = track.credit + growth
        pending = track.pending
        computed = legs = 0
        while pending and credit >= pending[0].prompt_tokens:
            c = pending[0]
            credit -= c.prompt_tokens
            computed += c.prefill_tokens
            legs += 1
            self._leave_pending(track, c)
        track.credit = credit if pending else 0
        return computed, legs

    def _apply_generation(self, track: _Progress, growth: int) -> None:
        decoding = [c for c in track.decoding.values() if not c.released]
        if not decoding:
            return
        share, extra = divmod(growth, len(decoding))
        for i, c in enumerate(decoding):
            take = min(share + (1 if i < extra else 0), c.decode_tokens - c.decode_done)
            if take > 0:
                c.decode_done += take
                self._decode[c.instance_id] -= take
            if c.decode_done >= c.decode_tokens:
                del track.decoding[id(c)]

    def _drained(self, track: _Progress | None, outstanding: int, now: float) -> int:
        if track is None or not track.rate or outstanding <= 0:
            return 0
        return min(outstanding, int(track.rate * max(0.0, now - track.anchor)))

    # --- readings ----------------------------------------------------------------------------------------

    def prefill_tokens(self, instance_id: str) -> int:
        """Prefill tokens still to compute on `instance_id`, as the engines' progress says."""
        outstanding = self._prefill.get(instance_id, 0)
        if outstanding <= 0:
            return 0
        return outstanding - self._drained(self._progress.get(instance_id), outstanding, self.clock())

    def committed_prefill_tokens(self, instance_id: str) -> int:
        """Prefill tokens of legs whose prefill is not reported done (no time model)."""
        return self._prefill.get(instance_id, 0)

    def decode_tokens(self, instance_id: str) -> int:
        """Decode tokens still to generate on `instance_id`."""
        return self._decode.get(instance_id, 0)

    def context_tokens(self, instance_id: str) -> int:
        """Context (KV footprint) tokens in flight on `instance_id`."""
        return self._context.get(instance_id, 0)

    def tokens(self, instance_id: str) -> int:
        """All tokens of work left on `instance_id`: prefill plus decode."""
        return self.prefill_tokens(instance_id) + self._decode.get(instance_id, 0)

    def decoding(self, instance_id: str) -> tuple[int, float]:
        """Legs past their prefill and still generating on `instance_id`, and their mean context in tokens (both
        0 without progress reports)."""
        track = self._progress.get(instance_id)
        legs = [c for c in track.decoding.values() if not c.released] if track is not None else []
        if not legs:
            return 0, 0.0
        return len(legs), sum(c.context_now for c in legs) / len(legs)

    def requests(self, instance_id: str) -> int:
        """Request legs in flight on `instance_id`."""
        return self._requests.get(instance_id, 0)

    @property
    def total_tokens(self) -> int:
        """Tokens of work left over all instances."""
        return sum(self.prefill_tokens(i) for i in self._prefill) + sum(self._decode.values())

    @property
    def total_requests(self) -> int:
        """Request legs in flight over all instances."""
        return sum(self._requests.values())


def _remove(queue: collections.deque, c: Commitment) -> None:
    for i, other in enumerate(queue):
        if other is c:
            del queue[i]
            return
