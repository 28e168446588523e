"""The restart tracker as `tandem up` uses it: backoff, budget reset after a stable run, FAILED but still retried."""

from __future__ import annotations

from mesh.config import RestartPolicy
from node_agent.config import RestartPolicy as AgentRestartPolicy
from tandem.restarts import RestartState, RestartTracker

POLICY = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=8, stable_after_s=60, failed_after=4)


def crash_quickly(tracker: RestartTracker, at: float) -> float:
    tracker.started(at)
    return tracker.exited(at + 1)


def test_the_first_exit_is_restarted_at_once_then_quick_exits_double_the_backoff_then_fail_and_keep_retrying():
    tracker = RestartTracker(POLICY)
    delays = [crash_quickly(tracker, t) for t in (0, 10, 20, 30, 40)]
    assert delays == [0.0, 1.0, 2.0, 8.0, 8.0]  # first_restart_s, then 2x, 4x initial_backoff_s, capped
    assert tracker.state is RestartState.FAILED and tracker.quick_exits == 5
    assert not tracker.due(40.5) and tracker.due(49)  # still retried, at the cap


def test_exits_far_apart_never_add_up():
    tracker = RestartTracker(POLICY)
    now = 0.0
    for _ in range(20):  # the old rule stopped the whole mesh at the sixth exit, however far apart
        tracker.started(now)
        assert not tracker.tick(now + 30)
        assert tracker.tick(now + 61)  # stable: budget reset
        assert tracker.exited(now + 100) == 0.0 and tracker.state is RestartState.BACKOFF  # at once
        now += 101
    assert tracker.quick_exits == 1


def test_a_failed_component_that_comes_back_is_running_again():
    tracker = RestartTracker(POLICY)
    for t in (0, 10, 20, 30):
        crash_quickly(tracker, t)
    assert tracker.state is RestartState.FAILED
    tracker.started(40)
    assert tracker.state is RestartState.FAILED  # until it proves stable
    assert tracker.tick(100) and tracker.state is RestartState.RUNNING and tracker.quick_exits == 0
    assert tracker.exited(200) == 0.0


def test_the_node_agents_policy_fits_and_a_launch_by_an_operator_starts_afresh():
    policy = AgentRestartPolicy(initial_backoff_s=0.1, max_backoff_s=0.2, max_consecutive_failures=2)
    tracker = RestartTracker(policy)
    assert crash_quickly(tracker, 0) == 0.1 and tracker.state is RestartState.BACKOFF
    crash_quickly(tracker, 10)
    assert tracker.state is RestartState.FAILED and tracker.quick_exits == 2
    tracker.reset()  # the agent leaves a FAILED engine alone until NodeAgent.Launch
    assert tracker.state is RestartState.STARTING and crash_quickly(tracker, 20) == 0.1


def test_a_first_restart_delay_when_configured():
    policy = RestartPolicy(first_restart_s=0.3, initial_backoff_s=0.5, max_backoff_s=8)
    tracker = RestartTracker(policy)
    assert [crash_quickly(tracker, t) for t in (0, 10, 20)] == [0.3, 1.0, 2.0]


def test_the_node_agents_engines_keep_their_initial_backoff():
    """An engine's first restart still waits `initial_backoff_s` (its accelerator memory or port may be held)."""
    tracker = RestartTracker(AgentRestartPolicy(initial_backoff_s=1.0, max_backoff_s=30))
    assert [crash_quickly(tracker, t) for t in (0, 10, 20)] == [1.0, 2.0, 4.0]
