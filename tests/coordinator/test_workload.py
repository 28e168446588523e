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
