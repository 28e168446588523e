"""Ingest core: batches from any source (agent stream, direct ZMQ) through freshness into the index. No I/O.

A *source* is an opaque token naming where a rank's batches come from (an agent's Ingest stream, a direct ZMQ
subscription); replay requests are addressed to the source that last delivered the rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from conductor.freshness import SequenceTracker, Step
from conductor.index import KvIndex
from tandem.kv_events import KvEvent

WINDOW_S = 10  # seconds of the events/s and lag windows


@dataclass(slots=True)
class IncomingBatch:
    """One engine rank's batch, whatever carried it."""

    instance_id: str
    dp_rank: int
    sequence: int  # the engine's batch sequence number
    model: str
    block_size: int
    ts: float  # engine wall-clock time of the batch (0 when unknown)
    events: list[KvEvent] = field(default_factory=list)
    replayed: bool = False  # read from the replay socket rather than the live publisher
    capacity_blocks: int = 0  # KV blocks the rank can hold, as its agent reports them (0: unknown)


@dataclass(slots=True)
class ReplayAsk:
    """Ask `source` to replay one rank from `from_sequence`."""

    source: Hashable
    instance_id: str
    dp_rank: int
    from_sequence: int


@dataclass(slots=True)
class IndexStats:
    """A snapshot of the conductor's figures (`GetIndexStats`, Prometheus)."""

    instances: int
    holders: int
    npu_blocks: int
    cpu_blocks: int
    disk_blocks: int
    entries: int
    events_per_second: float
    events_total: int
    batches_total: int
    max_event_lag_seconds: float
    gaps: int
    replays: int
    recovered: int
    clears: int
    restarts: int
    index_bytes: int
    evicted_entries: int
    rejected_entries: int
    orphan_blocks: int
    unresolved_blocks: int
    bad_events: int


class _Window:
    """Per-second buckets over the last `WINDOW_S` seconds: a sum and a max."""

    __slots__ = ("sums", "maxes")

    def __init__(self) -> None:
        self.sums: dict[int, float] = {}
        self.maxes: dict[int, float] = {}

    def add(self, now: float, count: float, value: float | None = None) -> None:
        sec = int(now)
        self.sums[sec] = self.sums.get(sec, 0.0) + count
        if value is not None and value > self.maxes.get(sec, float("-inf")):
            self.maxes[sec] = value
        if len(self.sums) > WINDOW_S + 2 or len(self.maxes) > WINDOW_S + 2:
            self._trim(sec)

    def _trim(self, sec: int) -> None:
        for d in (self.sums, self.maxes):
            for k in [k for k in d if k <= sec - WINDOW_S]:
                del d[k]

    def rate(self, now: float) -> float:
        sec = int(now)
        return sum(v for k, v in self.sums.items() if sec - WINDOW_S < k <= sec) / WINDOW_S

    def max(self, now: float) -> float:
        sec = int(now)
        values = [v for k, v in self.maxes.items() if sec - WINDOW_S < k <= sec]
        return max(values, default=0.0)


class IngestCore:
    """Feeds batches through the sequence tracker into the index and answers the figures."""

    def __init__(
        self,
        index: KvIndex,
        tracker: SequenceTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.tracker: SequenceTracker[tuple[str, int], IncomingBatch] = tracker or SequenceTracker()
        self.clock = clock
        self.wall = wall
        self.rank_source: dict[tuple[str, int], Hashable] = {}
        self.events_total = 0
        self.batches_total = 0
        self.bad_events = 0  # events the index could not apply (malformed values), skipped
        self._events = _Window()
        self._lag = _Window()

    # -- inputs ---------------------------------------------------------------------------------------------------

    def batch(self, b: IncomingBatch, source: Hashable, can_replay: bool = True) -> ReplayAsk | None:
        """One batch from `source`; returns the replay to ask for when it reveals a gap."""
        key = (b.instance_id, b.dp_rank)
        self.rank_source[key] = source
        now = self.clock()
        step = self.tracker.on_batch(key, b.sequence, b.replayed, b, now, can_replay)
        if not b.replayed and b.ts > 0:
            self._lag.add(now, 0, max(0.0, self.wall() - b.ts))
        self._run(key, step)
        if step.replay_from is not None:
            return ReplayAsk(source, b.instance_id, b.dp_rank, step.replay_from)
        return None

    def replay_done(self, instance_id: str, dp_rank: int, recovered: bool) -> None:
        """The source finished a replay (`recovered` false: it no longer had the asked sequence)."""
        key = (instance_id, dp_rank)
        self._run(key, self.tracker.on_replay_done(key, recovered))

    def instance_gone(self, instance_id: str) -> None:
        """The instance stopped: drop its entries and sequence state."""
        self.index.remove_instance(instance_id)
        for key in [k for k in self.rank_source if k[0] == instance_id]:
            del self.rank_source[key]
            self.tracker.forget(key)

    def source_lost(self, source: Hashable) -> None:
        """A source (agent stream) ended: ranks waiting for a replay from it are cleared."""
        keys = [k for k, s in self.rank_source.items() if s == source]
        for key, step in self.tracker.source_lost(keys):
            self._run(key, step)

    def tick(self) -> None:
        """Periodic: gives up replays past their deadline."""
        for key, step in self.tracker.expire(self.clock()):
            self._run(key, step)

    def _run(self, key: tuple[str, int], step: Step[IncomingBatch]) -> None:
        if step.clear:
            self.index.clear_holder(*key)
        if not step.apply:
            return
        index = self.index
        n_events = 0
        for b in step.apply:
            h = index.holder(b.instance_id, b.dp_rank, b.model, b.block_size)
            if b.capacity_blocks:
                h.limit = b.capacity_blocks
            for ev in b.events:
                try:
                    index.apply(h, ev)
                except (OverflowError, TypeError, ValueError):  # a token id that is no uint32, a bad hash...
                    self.bad_events += 1
            n_events += len(b.events)
        self.events_total += n_events
        self.batches_total += len(step.apply)
        self._events.add(self.clock(), n_events)

    # -- figures --------------------------------------------------------------------------------------------------

    def stats(self) -> IndexStats:
        now = self.clock()
        ix, fc = self.index, self.tracker.counters
        return IndexStats(
            instances=ix.instances(),
            holders=len(ix.holders),
            npu_blocks=ix.medium_entries[1],
            cpu_blocks=ix.medium_entries[2],
            disk_blocks=ix.medium_entries[3],
            entries=ix.entries,
            events_per_second=self._events.rate(now),
            events_total=self.events_total,
            batches_total=self.batches_total,
            max_event_lag_seconds=self._lag.max(now),
            gaps=fc.gaps,
            replays=fc.replays,
            recovered=fc.recovered,
            clears=fc.clears,
            restarts=fc.restarts,
            index_bytes=ix.approx_bytes(),
            evicted_entries=ix.counters.evicted_entries,
            rejected_entries=ix.counters.rejected_entries,
            orphan_blocks=ix.counters.orphan_blocks,
            unresolved_blocks=ix.counters.unresolved_blocks,
            bad_events=self.bad_events,
        )
