import pytest

from coordinator.workload import WorkloadLedger


def test_commit_and_release_return_to_zero():
    ledger = WorkloadLedger()
    a = ledger.commit("i1", 100, 10, 110)
    b = ledger.commit("i1", 50, 5, 55)
    c = ledger.commit("i2", 7, 0, 7)
    assert (ledger.prefill_tokens("i1"), ledger.decode_tokens("i1"), ledger.context_tokens("i1")) == (
        150,
        15,
        165,
    )
    assert ledger.tokens("i1") == 165 and ledger.requests("i1") == 2 and ledger.tokens("i2") == 7
    assert ledger.total_tokens == 172 and ledger.total_requests == 3
    for commitment in (a, b, c):
        assert ledger.release(commitment)
    assert ledger.total_tokens == 0 and ledger.total_requests == 0
    assert ledger.tokens("i1") == 0 and ledger.context_tokens("i1") == 0 and ledger.requests("i2") == 0


def test_release_is_exactly_once():
    ledger = WorkloadLedger()
    a = ledger.commit("i1", 10, 1)
    b = ledger.commit("i1", 20, 2)
    assert ledger.release(a) is True
    assert ledger.release(a) is False
    assert ledger.tokens("i1") == 22 and ledger.requests("i1") == 1
    ledger.release(b)
    assert ledger.total_tokens == 0


def test_negative_commit_is_refused():
    with pytest.raises(ValueError):
        WorkloadLedger().commit("i1", -1, 0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_prefill_leaves_when_the_prompt_counter_shows_it_done():
    clock = Clock()
    ledger = WorkloadLedger(clock)
    ledger.engine_progress("i1", {0: (1000, 50)})  # first report: baseline only
    a = ledger.commit("i1", 80, 10, 110, prompt_tokens=100)
    b = ledger.commit("i1", 200, 10, 210, prompt_tokens=200)
    assert ledger.prefill_tokens("i1") == 280
    clock.t = 0.25
    ledger.engine_progress("i1", {0: (1100, 51)})  # a's prompt counted (its first token)
    assert a.prefill_done and not b.prefill_done
    assert ledger.prefill_tokens("i1") == 200 and ledger.requests("i1") == 2
    ledger.engine_progress("i1", {0: (1300, 52)})
    assert ledger.prefill_tokens("i1") == 0
    assert ledger.decode_tokens("i1") < 20  # generated tokens left too
    # The request still runs: its decode and context stay until release.
    assert ledger.context_tokens("i1") == 320
    ledger.release(a)
    ledger.release(b)
    assert ledger.total_tokens == 0 and ledger.total_requests == 0


def test_partial_growth_waits_as_credit_and_foreign_traffic_is_ignored():
    ledger = WorkloadLedger(Clock())
    ledger.engine_progress("i1", {0: (0, 0)})
    ledger.engine_progress("i1", {0: (5000, 0)})  # traffic from elsewhere, nothing pending: dropped
    a = ledger.commit("i1", 100, 1, prompt_tokens=100)
    ledger.engine_progress("i1", {0: (5060, 0)})
    assert not a.prefill_done
    ledger.engine_progress("i1", {0: (5100, 0)})
    assert a.prefill_done


def test_generation_is_shared_among_decoding_requests_and_capped():
    ledger = WorkloadLedger(Clock())
    ledger.engine_progress("i1", {0: (0, 0)})
    a = ledger.commit("i1", 10, 4, prompt_tokens=10)
    b = ledger.commit("i1", 10, 100, prompt_tokens=10)
    ledger.engine_progress("i1", {0: (20, 2)})
    assert ledger.decode_tokens("i1") == 102
    ledger.engine_progress("i1", {0: (20, 22)})  # 10 each; a is capped at 4
    assert a.decode_done == 4 and b.decode_done == 11
    assert ledger.decode_tokens("i1") == 89
    ledger.release(a)
    assert ledger.decode_tokens("i1") == 89
    ledger.release(b)
    assert ledger.total_tokens == 0


def test_engine_restart_counter_reset_does_not_drift():
    clock = Clock()
    ledger = WorkloadLedger(clock)
    ledger.engine_progress("i1", {0: (9000, 900)})
    lost = ledger.commit("i1", 500, 5, prompt_tokens=500)  # routed to the old process, which then dies
    clock.t = 1
    ledger.engine_progress("i1", {0: (9000, 900)})
    clock.t = 2
    fresh = ledger.commit("i1", 300, 5, prompt_tokens=300)  # routed to the restarted engine
    clock.t = 3
    ledger.engine_progress("i1", {0: (300, 1)})  # counters went down: reset, counted from zero
    assert lost.prefill_done and fresh.prefill_done
    assert ledger.prefill_tokens("i1") == 0
    ledger.release(lost, started=False)
    ledger.release(fresh)
    assert ledger.total_tokens == 0 and ledger.total_requests == 0


def test_aborted_request_never_counted_does_not_swallow_a_later_prefill():
    clock = Clock()
    ledger = WorkloadLedger(clock, marker_lifetime_s=1.0)
    ledger.engine_progress("i1", {0: (0, 0)})
    aborted = ledger.commit("i1", 100, 5, prompt_tokens=100)
    later = ledger.commit("i1", 100, 5, prompt_tokens=100)
    ledger.release(aborted, started=False)  # cut before its first token: the engine never counts it
    ledger.engine_progress("i1", {0: (100, 1)})
    assert later.prefill_done and ledger.prefill_tokens("i1") == 0
    # Unknown whether it started: its marker waits a lifetime for the counter, then expires.
    unknown = ledger.commit("i1", 50, 5, prompt_tokens=50)
    ledger.release(unknown)
    clock.t = 5
    third = ledger.commit("i1", 70, 5, prompt_tokens=70)
    ledger.engine_progress("i1", {0: (170, 2)})
    assert third.prefill_done
    ledger.release(later)
    ledger.release(third)
    assert ledger.total_tokens == 0


def test_completed_request_released_before_the_report_is_still_matched():
    ledger = WorkloadLedger(Clock())
    ledger.engine_progress("i1", {0: (0, 0)})
    quick = ledger.commit("i1", 40, 1, prompt_tokens=40)
    slow = ledger.commit("i1", 60, 5, prompt_tokens=60)
    ledger.release(quick)  # done before the next report: its marker absorbs its own count
    ledger.engine_progress("i1", {0: (40, 1)})
    assert not slow.prefill_done and ledger.prefill_tokens("i1") == 60


def test_coordinator_restart_first_report_is_a_baseline():
    ledger = WorkloadLedger(Clock())  # a new coordinator: engines have long-running counters
    a = ledger.commit("i1", 100, 5, prompt_tokens=100)
    ledger.engine_progress("i1", {0: (10**9, 10**8)})
    assert not a.prefill_done and ledger.prefill_tokens("i1") == 100
    ledger.engine_progress("i1", {0: (10**9 + 100, 10**8 + 1)})
    assert a.prefill_done


def test_dp_ranks_are_summed_and_reset_per_rank():
    ledger = WorkloadLedger(Clock())
    ledger.engine_progress("i1", {0: (10, 0), 1: (20, 0)})
    a = ledger.commit("i1", 30, 1, prompt_tokens=30)
    b = ledger.commit("i1", 40, 1, prompt_tokens=40)
    ledger.engine_progress("i1", {0: (40, 1), 1: (20, 0)})
    assert a.prefill_done and not b.prefill_done
    ledger.engine_progress("i1", {0: (40, 1), 1: (60, 1)})
    assert b.prefill_done


def test_forget_progress_makes_the_next_report_a_baseline():
    ledger = WorkloadLedger(Clock())
    ledger.engine_progress("i1", {0: (100, 0)})
    ledger.forget_progress("i1")
    a = ledger.commit("i1", 10, 1, prompt_tokens=10)
    ledger.engine_progress("i1", {0: (5000, 0)})
    assert not a.prefill_done


def test_time_model_drains_at_the_calibrated_rate_between_reports():
    clock = Clock()
    ledger = WorkloadLedger(clock)
    ledger.set_prefill_rate("i1", 1000.0)
    ledger.engine_progress("i1", {0: (0, 0)})
    clock.t = 10.0  # idle for a while: the drain starts when work arrives, not at the last report
    a = ledger.commit("i1", 800, 1, prompt_tokens=800)
    assert ledger.prefill_tokens("i1") == 800
    clock.t = 10.3
    assert ledger.prefill_tokens("i1") == 500
    clock.t = 11.0
    assert ledger.prefill_tokens("i1") == 0 and ledger.committed_prefill_tokens("i1") == 800
    ledger.engine_progress("i1", {0: (800, 1)})  # re-anchored by the counter
    assert a.prefill_done and ledger.committed_prefill_tokens("i1") == 0
    ledger.release(a)
    assert ledger.total_tokens == 0


def test_explicit_prefill_done_and_release_once():
    ledger = WorkloadLedger(Clock())
    a = ledger.commit("i1", 100, 10, 110, prompt_tokens=100)
    assert ledger.prefill_done(a) and not ledger.prefill_done(a)
    assert ledger.prefill_tokens("i1") == 0 and ledger.decode_tokens("i1") == 10
    assert ledger.release(a) and not ledger.release(a) and not ledger.prefill_done(a)
    assert ledger.total_tokens == 0
