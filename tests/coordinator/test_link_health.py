"""Which P/D pairs to avoid after failed KV transfers: the decode instance's counters' rise is attributed to the
oldest transfers sent there, a blamed pair is avoided for the cooldown, a restarted engine's counters are a baseline,
and transfers nobody accounted for settle."""

from __future__ import annotations

from coordinator.link_health import LinkHealth


def test_a_failure_blames_the_pair_whose_transfer_ended_then_for_the_cooldown():
    links = LinkHealth(cooldown_s=30.0)
    assert links.observe("d0", 0, 0, now=0.0) == []  # the baseline
    links.sent("p-ok", "d0", now=1.0)
    assert links.observe("d0", 1, 0, now=1.5) == []  # p-ok's transfer ended well
    links.sent("p-bad", "d0", now=2.0)
    assert links.observe("d0", 1, 1, now=2.5) == [("p-bad", "d0")]
    assert links.avoided("p-bad", "d0", now=3.0) and not links.avoided("p-ok", "d0", now=3.0)
    assert not links.avoided("p-bad", "d1", now=3.0)  # the pair, not the prefill instance
    assert not links.avoided("p-bad", "d0", now=32.6)  # tried again after the cooldown
    links.sent("p-bad", "d0", now=33.0)
    assert links.observe("d0", 1, 2, now=33.5) == [("p-bad", "d0")]  # and blamed again if it still fails


def test_transfers_that_ended_together_with_a_failure_are_all_blamed():
    links = LinkHealth()
    links.observe("d0", 0, 0, now=0.0)
    for prefill in ("p0", "p1", "p0"):
        links.sent(prefill, "d0", now=1.0)
    assert links.observe("d0", 1, 1, now=2.0) == [("p0", "d0"), ("p1", "d0")]  # two ended, one failed: both
    assert links.observe("d0", 2, 1, now=2.5) == []  # the third ended well


def test_a_restarted_engine_or_a_first_reading_blames_nobody():
    links = LinkHealth()
    links.sent("p0", "d0", now=0.0)
    assert links.observe("d0", 5, 7, now=1.0) == []  # first reading: counts from before are not ours
    links.sent("p0", "d0", now=2.0)
    assert links.observe("d0", 0, 0, now=3.0) == []  # lower: the engine restarted
    assert links.observe("d0", 0, 1, now=4.0) == [("p0", "d0")]


def test_transfers_nobody_accounted_for_settle_and_take_no_blame():
    links = LinkHealth(settle_s=10.0)
    links.observe("d0", 0, 0, now=0.0)
    links.sent("p-old", "d0", now=0.0)  # its end was never counted (the engine reports no transfers)
    links.sent("p-new", "d0", now=15.0)
    assert links.observe("d0", 0, 1, now=16.0) == [("p-new", "d0")]
