"""`tandem up`'s restart policy: backoff, budget reset after a stable run, FAILED but still retried."""

from __future__ import annotations

from mesh.restarts import ComponentState, RestartPolicy, RestartTracker

POLICY = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=8, stable_after_s=60, failed_after=4)


def crash_quickly(tracker: RestartTracker, at: float) -> float:
    tracker.started(at)
    return tracker.exited(at + 1)


def test_quick_exits_double_the_backoff_then_fail_and_keep_retrying():
    tracker = RestartTracker(POLICY)
    delays = [crash_quickly(tracker, t) for t in (0, 10, 20, 30, 40)]
    assert delays == [0.5, 1.0, 2.0, 8.0, 8.0]
    assert tracker.state is ComponentState.FAILED and tracker.quick_exits == 5
    assert not tracker.due(40.5) and tracker.due(49)  # still retried, at the cap


def test_exits_far_apart_never_add_up():
    tracker = RestartTracker(POLICY)
    now = 0.0
    for _ in range(20):  # the old rule stopped the whole mesh at the sixth exit, however far apart
        tracker.started(now)
        assert not tracker.tick(now + 30)
        assert tracker.tick(now + 61)  # stable: budget reset
        assert tracker.exited(now + 100) == 0.5 and tracker.state is ComponentState.BACKOFF
        now += 101
    assert tracker.quick_exits == 1


def test_a_failed_component_that_comes_back_is_running_again():
    tracker = RestartTracker(POLICY)
    for t in (0, 10, 20, 30):
        crash_quickly(tracker, t)
    assert tracker.state is ComponentState.FAILED
    tracker.started(40)
    assert tracker.state is ComponentState.FAILED  # until it proves stable
    assert tracker.tick(100) and tracker.state is ComponentState.RUNNING and tracker.quick_exits == 0
    assert tracker.exited(200) == 0.5
