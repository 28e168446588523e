"""Freshness: sequence tracking, gap -> replay -> recovered, unrecoverable -> clear, restarts, timeouts."""

from __future__ import annotations

import pytest

from conductor.freshness import SequenceTracker
from conductor.index import KvIndex
from conductor.ingest import IncomingBatch, IngestCore
from conductor.match import match
from tandem.kv_events import BlockRemoved, BlockStored, Medium

BS = 4
PROMPT = list(range(32))


def stored(first, last):
    return BlockStored(
        list(range(first, last)), first - 1 if first else None, PROMPT[first * BS : last * BS], BS, Medium.NPU
    )


def removed(*blocks):
    return BlockRemoved(list(blocks), Medium.NPU)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make_core(max_pending=100):
    clock = Clock()
    core = IngestCore(
        KvIndex(),
        SequenceTracker(max_pending=max_pending, replay_timeout_s=5.0),
        clock=clock,
        wall=lambda: 0.0,
    )
    return core, clock


def B(seq, *events, replayed=False, inst="a", rank=0):
    return IncomingBatch(inst, rank, seq, "m", BS, 0.0, list(events), replayed)


def blocks(core, inst="a"):
    res = match(core.index, "m", token_ids=PROMPT)
    return {h.instance_id: h.matched_tokens // BS for h in res.instances}.get(inst, 0)


# (name, steps, expected blocks of "a", expected counters)
# a step is ("b", seq, events, replayed) -> expects replay_from or None, ("done", recovered), ("tick", dt), ("lost",)
CASES = [
    ("in order", [("b", 0, [stored(0, 2)], False, None), ("b", 1, [stored(2, 4)], False, None)], 4, {}),
    ("first batch sets the baseline", [("b", 57, [stored(0, 3)], False, None)], 3, {}),
    (
        "gap replayed and recovered, held live batch applied after",
        [
            ("b", 0, [stored(0, 2)], False, None),
            ("b", 3, [stored(4, 6)], False, 1),  # 1 and 2 missing: held, replay asked from 1
            ("b", 1, [stored(2, 3)], True, None),
            ("b", 2, [stored(3, 4)], True, None),
            ("b", 3, [stored(4, 6)], True, None),  # the replay includes what we hold: skipped later
            ("done", True),
        ],
        6,
        {"gaps": 1, "replays": 1, "recovered": 1, "clears": 0},
    ),
    (
        "removal inside a replayed gap is applied in order",
        [
            ("b", 0, [stored(0, 4)], False, None),
            ("b", 2, [], False, 1),
            ("b", 1, [removed(1)], True, None),
            ("done", True),
        ],
        1,
        {"recovered": 1},
    ),
    (
        "unrecoverable gap clears the rank, then live carries on",
        [
            ("b", 0, [stored(0, 4)], False, None),
            ("b", 5, [stored(4, 5)], False, 1),
            ("done", False),
        ],
        0,
        {"gaps": 1, "replays": 1, "clears": 1},
    ),
    (
        "replay starting past the asked sequence clears",
        [
            ("b", 0, [stored(0, 4)], False, None),
            ("b", 5, [], False, 1),
            ("b", 3, [stored(0, 1)], True, None),  # the engine no longer had 1 and 2
            ("b", 4, [], True, None),
            ("b", 5, [], True, None),
            ("done", False),
        ],
        1,
        {"clears": 1},
    ),
    (
        "replay that never finishes times out and clears",
        [("b", 0, [stored(0, 4)], False, None), ("b", 2, [], False, 1), ("tick", 6.0)],
        0,
        {"clears": 1},
    ),
    (
        "agent stream lost during replay clears",
        [("b", 0, [stored(0, 4)], False, None), ("b", 2, [], False, 1), ("lost",)],
        0,
        {"clears": 1},
    ),
    (
        "engine restart (sequence back to 0) clears and restarts",
        [("b", 10, [stored(0, 4)], False, None), ("b", 0, [stored(0, 1)], False, None)],
        1,
        {"restarts": 1, "clears": 0},
    ),
    (
        "replayed duplicates are skipped (agent reconnect replay)",
        [
            ("b", 0, [stored(0, 2)], False, None),
            ("b", 1, [removed(0)], False, None),
            ("b", 0, [stored(0, 2)], True, None),
        ],
        0,
        {"duplicates": 1},
    ),
    (
        "ReplayDone nobody asked for is ignored",
        [("b", 0, [stored(0, 2)], False, None), ("done", False)],
        2,
        {"clears": 0},
    ),
]


@pytest.mark.parametrize(
    ("steps", "want_blocks", "want_counters"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_freshness(steps, want_blocks, want_counters):
    core, clock = make_core()
    for step in steps:
        if step[0] == "b":
            _, seq, events, replayed, want_replay = step
            ask = core.batch(B(seq, *events, replayed=replayed), "agent")
            assert (ask.from_sequence if ask else None) == want_replay
        elif step[0] == "done":
            core.replay_done("a", 0, step[1])
        elif step[0] == "tick":
            clock.t += step[1]
            core.tick()
        elif step[0] == "lost":
            core.source_lost("agent")
    assert blocks(core) == want_blocks
    counters = core.tracker.counters
    for name, value in want_counters.items():
        assert getattr(counters, name) == value, name


def test_gap_without_replay_socket_clears_at_once():
    core, _ = make_core()
    core.batch(B(0, stored(0, 4)), "direct", can_replay=False)
    assert core.batch(B(2, stored(0, 1)), "direct", can_replay=False) is None
    assert blocks(core) == 1 and core.tracker.counters.clears == 1


def test_too_many_held_batches_give_up_the_replay():
    core, _ = make_core(max_pending=2)
    core.batch(B(0, stored(0, 4)), "agent")
    assert core.batch(B(2), "agent").from_sequence == 1
    core.batch(B(3), "agent")
    core.batch(B(4, stored(0, 2)), "agent")  # third held batch: over the bound
    assert blocks(core) == 2
    assert core.tracker.counters.clears == 1 and not core.tracker.replaying(("a", 0))


def test_ranks_are_independent_and_stats():
    core, _ = make_core()
    core.batch(B(0, stored(0, 4), rank=0), "agent")
    core.batch(B(0, stored(0, 2), rank=1), "agent")
    core.batch(B(3, rank=1), "agent")
    core.replay_done("a", 1, False)
    res = match(core.index, "m", token_ids=PROMPT)
    assert [(r.dp_rank, r.npu_blocks) for r in res.instances[0].ranks] == [(0, 4)]
    s = core.stats()
    assert (s.instances, s.holders, s.npu_blocks, s.gaps, s.replays, s.clears) == (1, 2, 4, 1, 1, 1)
    assert s.events_total == 2 and s.index_bytes > 0


def test_instance_gone_forgets_sequences():
    core, _ = make_core()
    core.batch(B(5, stored(0, 4)), "agent")
    core.instance_gone("a")
    assert blocks(core) == 0 and core.stats().holders == 0
    assert (
        core.batch(B(0, stored(0, 1)), "agent") is None
    )  # a new incarnation starts afresh, no restart counted
    assert blocks(core) == 1 and core.tracker.counters.restarts == 0


def test_malformed_event_is_skipped_and_counted():
    core, _ = make_core()
    bad = BlockStored([1], None, [2**40] * BS, BS, Medium.NPU)
    core.batch(B(0, bad, stored(0, 2)), "agent")
    assert blocks(core) == 2 and core.stats().bad_events == 1
