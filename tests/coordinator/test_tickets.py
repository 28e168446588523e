"""Exactly-once accounting of routed requests: the ticket table against random orders of everything that can
happen to a request and to the access log stream (hypothesis state machine), plus plain examples.

The model keeps the truth the coordinator cannot see: which requests are still running on an engine. Safety: a
commitment is released at most once, only after the event that justifies it (its request's log entry, an abort
before the decision left, its lifetime, or its engines really idle). Liveness: once every request has ended and
lifetimes have passed, every counter is back at zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.tickets import (
    ABORTED,
    CLIENT_GONE,
    COMPLETED,
    EXPIRED,
    FAILED,
    RECONCILED,
    Ticket,
    TicketTable,
)
from coordinator.workload import Commitment, WorkloadLedger
from tandem.engine_load import EngineLoad

LIFETIME = 100.0
GRACE = 2.0
INSTANCES = ("i0", "i1")


@dataclass
class Request:
    """The truth about one request."""

    incarnation: int
    ticket: Ticket
    commitment: Commitment
    request_id: str
    state: str = "deciding"  # deciding | routed | aborted
    reached_engine: bool = False  # the decision reached Envoy and the engine got the request
    running: bool = False  # on the engine now
    logged: bool = False  # Envoy queued its log entry


@dataclass
class Entry:
    """An access log entry Envoy holds until it can send it."""

    incarnation: int  # of the coordinator whose ticket it names
    ticket: str  # "" when the decision never reached the route
    request_id: str
    reason: str


class Coordinator(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0
        self.incarnation = 0
        self.requests: list[Request] = []
        self.queue: list[Entry] = []  # entries logged, not yet sent
        self.delivered: set[str] = set()  # tickets whose entry reached a table
        self.stream_up = False
        self.numbers = 0
        self._new_process()

    def _new_process(self) -> None:
        self.incarnation += 1
        self.ledger = WorkloadLedger()
        self.table = TicketTable(
            self.ledger, LIFETIME, GRACE, clock=lambda: self.clock, incarnation=f"inc{self.incarnation}"
        )
        if self.stream_up:  # Envoy reconnects its log stream to the new process
            self.table.stream_opened()

    def _live(self) -> list[Request]:
        return [r for r in self.requests if r.incarnation == self.incarnation]

    # --- what happens to requests -------------------------------------------------------------------------
    @rule(instance=st.sampled_from(INSTANCES), tokens=st.integers(0, 50), shared_id=st.booleans())
    def decide(self, instance, tokens, shared_id):
        self.numbers += 1
        # Clients may reuse request ids; the table must never rely on them being unique.
        request_id = "dup" if shared_id else f"r{self.numbers}"
        commitment = self.ledger.commit(instance, tokens, tokens, 2 * tokens)
        ticket = self.table.issue([commitment], request_id)
        self.requests.append(Request(self.incarnation, ticket, commitment, request_id))

    @precondition(lambda self: any(r.state == "deciding" for r in self._live()))
    @rule(data=st.data(), reply_dropped=st.booleans())
    def reply_sent(self, data, reply_dropped):
        """The decision was written; Envoy forwards the request (or drops the reply: the client left first)."""
        r = data.draw(st.sampled_from([r for r in self._live() if r.state == "deciding"]))
        if reply_dropped:
            self.queue.append(Entry(r.incarnation, "", r.request_id, CLIENT_GONE))
            r.logged = True
        elif not r.logged:
            r.reached_engine = r.running = True
        # The ack may come before or after Envoy logs the end: `routed` is a separate rule.

    @precondition(lambda self: any(r.state == "deciding" for r in self._live()))
    @rule(data=st.data())
    def ack(self, data):
        r = data.draw(st.sampled_from([r for r in self._live() if r.state == "deciding"]))
        self.table.routed(r.ticket)
        r.state = "routed"

    @precondition(
        lambda self: any(
            r.state == "deciding" and not r.reached_engine and not r.logged for r in self._live()
        )
    )
    @rule(data=st.data())
    def abort(self, data):
        """The decision failed or was cancelled before it left."""
        choices = [r for r in self._live() if r.state == "deciding" and not r.reached_engine and not r.logged]
        r = data.draw(st.sampled_from(choices))
        released = self.table.abort(r.ticket)
        assert released == (not r.ticket.ended or r.ticket.ended == ABORTED)
        r.state = "aborted"
        assert r.commitment.released

    @precondition(lambda self: any(r.running for r in self.requests))
    @rule(data=st.data(), reason=st.sampled_from([COMPLETED, FAILED, CLIENT_GONE]))
    def request_ends(self, data, reason):
        """The HTTP stream ends on the engine side; Envoy queues its log entry."""
        r = data.draw(st.sampled_from([r for r in self.requests if r.running]))
        r.running = False
        r.logged = True
        self.queue.append(Entry(r.incarnation, r.ticket.id, r.request_id, reason))

    # --- the access log stream ------------------------------------------------------------------------------
    @precondition(lambda self: self.queue and self.stream_up)
    @rule(data=st.data(), duplicate=st.booleans())
    def deliver(self, data, duplicate):
        """Envoy sends one queued entry (in any order), possibly twice."""
        entry = self.queue.pop(data.draw(st.integers(0, len(self.queue) - 1)))
        for _ in range(2 if duplicate else 1):
            if entry.ticket:
                self.table.end(entry.ticket, entry.reason)
                self.delivered.add(entry.ticket)
            else:
                self.table.ended_without_ticket(entry.request_id)

    @precondition(lambda self: not self.stream_up)
    @rule()
    def stream_connects(self):
        self.stream_up = True
        self.table.stream_opened()

    @precondition(lambda self: self.stream_up)
    @rule()
    def stream_breaks(self):
        """ALS is at-most-once: what Envoy held is lost."""
        self.stream_up = False
        self.queue.clear()
        self.table.stream_closed()

    @precondition(lambda self: self.queue)
    @rule(data=st.data())
    def entry_lost(self, data):
        """An entry lost in flight (Envoy's buffer overflowed, or the stream broke as it was written)."""
        self.queue.pop(data.draw(st.integers(0, len(self.queue) - 1)))

    # --- time, engines and restarts -------------------------------------------------------------------------
    @rule(dt=st.floats(0.1, 60.0))
    def time_passes(self, dt):
        self.clock += dt

    @rule()
    def expire(self):
        self.table.expire()

    @rule()
    def engines_report(self):
        """Every engine reports its running requests (the truth) now; the table reconciles."""
        loads = {
            iid: EngineLoad(
                running=sum(1 for r in self.requests if r.running and r.commitment.instance_id == iid),
                sampled_at=self.clock,
            )
            for iid in INSTANCES
        }
        self.table.reconcile(loads)

    @rule()
    def coordinator_restarts(self):
        """SIGKILL and restart: the ledger and tickets die with the process; requests go on."""
        self.stream_up = False
        self.queue = [e for e in self.queue]  # Envoy keeps what it holds; the stream reconnects later
        self._new_process()

    # --- what must always hold ------------------------------------------------------------------------------
    @invariant()
    def ledger_matches_outstanding_commitments(self):
        held = [r.commitment for r in self._live() if not r.commitment.released]
        assert self.ledger.total_requests == len(held)
        assert self.ledger.total_tokens == sum(c.prefill_tokens + c.decode_tokens for c in held)
        for iid in INSTANCES:
            assert self.ledger.prefill_tokens(iid) >= 0 and self.ledger.requests(iid) >= 0
        assert len(self.table) == len(held)

    @invariant()
    def every_release_is_justified(self):
        for r in self._live():
            reason = r.ticket.ended
            assert bool(reason) == r.commitment.released
            if reason in (COMPLETED, FAILED, CLIENT_GONE):
                assert r.ticket.id in self.delivered
            elif reason == ABORTED:
                assert not r.reached_engine
            elif reason == EXPIRED:
                assert self.clock >= r.ticket.issued_at + LIFETIME
            elif reason == RECONCILED:
                assert not r.running  # never while the engine still runs it

    def teardown(self):
        """Liveness: every request ends, lifetimes pass, and the counters are back at zero."""
        for r in self.requests:
            r.running = False
        self.clock += LIFETIME + 1
        self.table.expire()
        assert self.ledger.total_requests == 0 and self.ledger.total_tokens == 0
        assert len(self.table) == 0


Coordinator.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestTicketOrders = Coordinator.TestCase


def make_table(lifetime: float = 10.0):
    now = [0.0]
    ledger = WorkloadLedger()
    return ledger, TicketTable(ledger, lifetime, GRACE, clock=lambda: now[0], incarnation="x"), now


def test_end_before_ack_then_abort_releases_once():
    ledger, table, _ = make_table()
    ticket = table.issue([ledger.commit("i0", 5, 5)], "r")
    assert table.end(ticket.id, COMPLETED)
    table.routed(ticket)
    assert not table.abort(ticket) and not table.end(ticket.id)
    assert ledger.total_requests == 0 and table.counters.unknown == 1


def test_on_end_runs_once_before_the_release():
    ledger, table, _ = make_table()
    seen = []
    ticket = table.issue([ledger.commit("i0", 5, 5)], "r", on_end=lambda: seen.append(ledger.total_requests))
    table.routed(ticket)
    table.end(ticket.id, CLIENT_GONE)
    table.end(ticket.id, CLIENT_GONE)
    assert seen == [1] and ledger.total_requests == 0


def test_lost_entries_are_reconciled_with_idle_engines_not_busy_ones():
    ledger, table, now = make_table(lifetime=1000)
    table.stream_opened()
    a = table.issue([ledger.commit("i0", 5, 5)], "a")
    b = table.issue([ledger.commit("i1", 5, 5)], "b")
    for t in (a, b):
        table.routed(t)
    assert (
        table.reconcile({"i0": EngineLoad(sampled_at=10), "i1": EngineLoad(sampled_at=10)}) == []
    )  # confirmed
    table.stream_closed()  # entries may be lost from here
    now[0] = 1.0
    for t in (a, b):
        table.routed(t)
    now[0] = 2.0
    assert (
        table.reconcile({"i0": EngineLoad(sampled_at=1.0), "i1": EngineLoad(sampled_at=1.0)}) == []
    )  # grace
    busy, idle = EngineLoad(running=1, sampled_at=3.5), EngineLoad(sampled_at=3.5)
    assert table.reconcile({"i0": idle, "i1": busy}) == [a.id]
    c = table.issue([ledger.commit("i1", 5, 5)], "c")  # a decision still being made: never reconciled
    now[0] = 100.0
    assert table.reconcile({"i1": EngineLoad(sampled_at=100.0)}) == [b.id]
    assert c.id in table
    assert ledger.requests("i0") == 0 and ledger.requests("i1") == 1


def test_a_confirmed_ticket_whose_entry_never_comes_is_reconciled_once_its_engine_stays_idle():
    ledger, table, now = make_table(lifetime=1000)
    table.stream_opened()
    ticket = table.issue([ledger.commit("i0", 5, 5)], "a")
    table.routed(ticket)
    assert table.reconcile({"i0": EngineLoad(sampled_at=29.0)}) == []  # idle, but the entry may still come
    assert table.reconcile({"i0": EngineLoad(running=1, sampled_at=31.0)}) == []  # still served
    assert table.reconcile({"i0": EngineLoad(sampled_at=31.0)}) == [ticket.id]
    assert ledger.total_requests == 0


def test_tickets_issued_before_any_stream_are_unconfirmed_and_restarts_do_not_collide():
    ledger, table, _ = make_table()
    ticket = table.issue([ledger.commit("i0", 1, 1)])
    assert ticket.unconfirmed
    other = TicketTable(WorkloadLedger(), 10.0)
    assert not other.end(ticket.id)  # a restarted coordinator ignores its predecessor's tickets
