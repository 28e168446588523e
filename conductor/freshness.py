"""Freshness: per (instance, DP rank) sequence tracking, gaps, replays and clears. Pure state machine, no I/O.

Each engine rank numbers its batches; the tracker decides, batch by batch, what the index does with it:

- in order (or the first batch seen): apply;
- older than expected: a replayed duplicate is skipped; a live one means the engine restarted (its sequence
  reset, its cache is empty): clear the rank, then apply;
- newer than expected on the live stream: a gap. If the rank's source can replay, ask for a replay from the
  first missing sequence and hold live batches (bounded) until `ReplayDone`; otherwise clear the rank and apply.
- during a replay, replayed batches are applied in order; a hole inside the replay (the engine's buffer no longer
  had the asked sequence), `ReplayDone{recovered: false}`, a timeout, or too many held batches clear the rank,
  which then carries on from what it has: the index never serves hits that a lost `BlockRemoved` made stale.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)  # a rank's key (the conductor uses (instance_id, dp_rank))


@dataclass(slots=True)
class Step(Generic[T]):
    """What to do after one input: clear the rank first (if `clear`), then apply `apply` in order."""

    clear: bool = False
    apply: list[T] = field(default_factory=list)
    replay_from: int | None = None  # ask the rank's source to replay from this sequence


@dataclass(slots=True)
class RankSeq:
    """Sequence state of one engine rank."""

    expected: int | None = None  # next sequence wanted; None before the first batch
    replay_from: int | None = None  # the sequence a running replay was asked from; None when not replaying
    replay_deadline: float = 0.0  # monotonic time after which the running replay is given up
    pending: list[tuple[int, Any]] = field(default_factory=list)  # live batches held during the replay
    last_seen: int = -1  # highest sequence seen (live or replayed)
    hole_cleared: bool = False  # the running replay already had a hole and cleared the rank


@dataclass(slots=True)
class FreshnessCounters:
    """Monotonic counters since start."""

    gaps: int = 0  # sequence gaps seen (live, or in an unasked replay)
    replays: int = 0  # replays asked for
    recovered: int = 0  # replays that closed their gap
    clears: int = 0  # ranks cleared because events were lost (unrecoverable gap, timeout, overflow)
    restarts: int = 0  # engine restarts seen (sequence went back)
    duplicates: int = 0  # replayed batches already applied, skipped


class SequenceTracker(Generic[K, T]):
    """Sequence state of every engine rank; `T` is the caller's batch type, passed through untouched."""

    def __init__(self, max_pending: int = 10_000, replay_timeout_s: float = 10.0) -> None:
        self.max_pending = max_pending
        self.replay_timeout_s = replay_timeout_s
        self.ranks: dict[K, RankSeq] = {}
        self.counters = FreshnessCounters()

    def forget(self, key: K) -> None:
        """Drops a rank's state (its instance went away)."""
        self.ranks.pop(key, None)

    def replaying(self, key: K) -> bool:
        st = self.ranks.get(key)
        return st is not None and st.replay_from is not None

    def on_batch(self, key: K, seq: int, replayed: bool, batch: T, now: float, can_replay: bool) -> Step[T]:
        """Decides about one batch of rank `key`; `can_replay` tells whether its source has a replay socket."""
        st = self.ranks.get(key)
        if st is None:
            st = self.ranks[key] = RankSeq()
        if seq > st.last_seen:
            st.last_seen = seq
        if st.replay_from is not None:
            return self._during_replay(st, seq, replayed, batch)
        if st.expected is None or seq == st.expected:
            st.expected = seq + 1
            return Step(apply=[batch])
        if seq < st.expected:
            if replayed:
                self.counters.duplicates += 1
                return Step()
            self.counters.restarts += 1
            st.expected = seq + 1
            return Step(clear=True, apply=[batch])
        self.counters.gaps += 1
        if replayed or not can_replay:  # a hole in a replay cannot be replayed again
            self.counters.clears += 1
            st.expected = seq + 1
            return Step(clear=True, apply=[batch])
        self.counters.replays += 1
        st.replay_from = st.expected
        st.replay_deadline = now + self.replay_timeout_s
        st.pending = [(seq, batch)]
        return Step(replay_from=st.expected)

    def _during_replay(self, st: RankSeq, seq: int, replayed: bool, batch: T) -> Step[T]:
        assert st.expected is not None
        if not replayed:
            if len(st.pending) < self.max_pending:
                st.pending.append((seq, batch))
                return Step()
            held = self._end_replay(st)  # too far behind: give up the replay, keep what is live
            self.counters.clears += 1
            st.expected = seq + 1
            return Step(clear=True, apply=[*(b for _, b in sorted(held, key=lambda x: x[0])), batch])
        if seq < st.expected:
            self.counters.duplicates += 1
            return Step()
        if seq == st.expected:
            st.expected = seq + 1
            return Step(apply=[batch])
        # the engine's buffer no longer had what we asked (the same gap, not a new one): clear, carry on
        self.counters.clears += 1
        st.hole_cleared = True
        st.expected = seq + 1
        return Step(clear=True, apply=[batch])

    def on_replay_done(self, key: K, recovered: bool) -> Step[T]:
        """The source finished the replay; releases held live batches."""
        st = self.ranks.get(key)
        if st is None or st.replay_from is None:
            return Step()  # a replay nobody asked (an agent's reconnect replay): nothing held
        if not recovered:
            if st.hole_cleared:  # already cleared at the hole; what was replayed since is good
                return self._release(st, self._end_replay(st), clear=False)
            self.counters.clears += 1
            return self._release(st, self._end_replay(st), clear=True)
        self.counters.recovered += 1
        return self._release(st, self._end_replay(st), clear=False)

    def expire(self, now: float) -> list[tuple[K, Step[T]]]:
        """Gives up replays past their deadline: each such rank is cleared and its held batches applied."""
        out = []
        for key, st in self.ranks.items():
            if st.replay_from is not None and now >= st.replay_deadline:
                self.counters.clears += 1
                out.append((key, self._release(st, self._end_replay(st), clear=True)))
        return out

    def source_lost(self, keys: list[K]) -> list[tuple[K, Step[T]]]:
        """The stream carrying these ranks ended: a replay it owed will not come, so those ranks are cleared."""
        out = []
        for key in keys:
            st = self.ranks.get(key)
            if st is not None and st.replay_from is not None:
                self.counters.clears += 1
                out.append((key, self._release(st, self._end_replay(st), clear=True)))
        return out

    @staticmethod
    def _end_replay(st: RankSeq) -> list[Any]:
        held = st.pending
        st.pending = []
        st.replay_from = None
        st.hole_cleared = False
        return held

    def _release(self, st: RankSeq, held: list[tuple[int, T]], clear: bool) -> Step[T]:
        step: Step[T] = Step(clear=clear)
        for seq, batch in sorted(held, key=lambda x: x[0]):
            if clear:  # after a clear, what is live is all there is: apply everything from here on
                st.expected = seq + 1
                step.apply.append(batch)
            elif st.expected is None or seq == st.expected:
                st.expected = seq + 1
                step.apply.append(batch)
            elif seq < st.expected:
                self.counters.duplicates += 1
            else:  # the replay ended short of the held batches: events in between are lost
                self.counters.clears += 1
                clear = step.clear = True
                step.apply.clear()  # anything released before the hole is cleared anyway
                st.expected = seq + 1
                step.apply.append(batch)
        return step
