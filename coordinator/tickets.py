"""Tickets: what a routed request holds until Envoy says it ended (pure core, no I/O).

The coordinator issues one ticket per routing decision and hands it to Envoy with the decision (dynamic metadata
or a header); Envoy's gRPC access log (ALS) names the ticket when the HTTP stream ends, completed, failed or cut
by the client. Ending the ticket releases the workload it holds, exactly once, and runs its end hook (trigger
mode: close the attempt, which cancels a prefill leg still in flight).

ALS is at-most-once: entries logged while no stream is connected are lost (Envoy counts none as dropped). So:
- every ticket has a lifetime; past it the ticket is released whatever happened (`expire`);
- a ticket that was outstanding while no ALS stream was connected, or whose request Envoy logged without it
  (the reply was dropped as the client left), is *unconfirmed*: it is also released when every engine it uses
  reports no request running or waiting in a sample taken at least `grace_s` after the decision left
  (`reconcile`), which is what the engines themselves say about the lost entries;
- a coordinator that restarts starts with an empty table and a new incarnation prefix: entries for the old
  incarnation's tickets are unknown here and ignored (its ledger died with it).

The life of a ticket: `issue` (decision made, workload committed) -> `routed` (the reply left for Envoy) or
`abort` (the decision never reached Envoy: release now) -> `end` (ALS entry), `expire` or `reconcile`. Any of
the releasing events may come in any order, any number of times: the first one releases, the rest do nothing.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from coordinator.workload import Commitment, WorkloadLedger

#: Why a ticket ended (a label of the coordinator's `tickets_ended` metric).
COMPLETED = "completed"  # the response ended normally
FAILED = "failed"  # Envoy or the engine failed the request
CLIENT_GONE = "client_gone"  # the client went away before the response ended
ABORTED = "aborted"  # the decision never reached Envoy
EXPIRED = "expired"  # the ticket outlived its lifetime
RECONCILED = "reconciled"  # its entry was lost and the engines report idle
REASONS = (COMPLETED, FAILED, CLIENT_GONE, ABORTED, EXPIRED, RECONCILED)


class EngineSample(Protocol):
    """What reconciliation needs from an engine's reported load (`tandem.engine_load.EngineLoad` fits)."""

    running: int
    waiting: int
    sampled_at: float  # wall clock of the sample


@dataclass(slots=True)
class Ticket:
    """One routed request's holdings."""

    id: str
    commitments: list[Commitment]  # released when the ticket ends
    request_id: str  # the request's id as Envoy logs it when the decision did not reach the route
    issued_at: float  # wall clock
    expires_at: float  # wall clock
    on_end: Callable[[], object] | None = None  # run once when the ticket ends (before the release)
    routed_at: float = 0.0  # wall clock when the reply left for Envoy; 0 until then
    unconfirmed: bool = False  # outstanding while no ALS stream was connected: its entry may be lost
    ended: str = ""  # why it ended; "" while outstanding
    #: Run once with the ticket when it ends, after the release, whatever the reason (the tenant quota's settle).
    on_release: Callable[[Ticket], object] | None = None
    response_bytes: int | None = None  # the response body's size as Envoy logged it; None when not logged
    #: What the coordinator expected of its choice (`coordinator.routing_quality.Prediction`), for the SLIs.
    prediction: object | None = None

    @property
    def routed(self) -> bool:
        """The reply left for Envoy: only Envoy's log, expiry or reconcile end the ticket now."""
        return self.routed_at > 0

    @property
    def instance_ids(self) -> set[str]:
        return {c.instance_id for c in self.commitments}


@dataclass(slots=True)
class TicketCounters:
    """Tickets ended by reason, and log entries that named no outstanding ticket."""

    ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    unknown: int = 0  # duplicates, another incarnation's tickets, or tickets already expired


class TicketTable:
    """Outstanding tickets by id; every commitment they hold is released exactly once."""

    def __init__(
        self,
        ledger: WorkloadLedger,
        lifetime_s: float,
        grace_s: float = 2.0,
        clock: Callable[[], float] = time.time,
        incarnation: str | None = None,
        stale_s: float = 30.0,
    ) -> None:
        self.ledger = ledger
        #: Called after any ticket's release (its workload gone from the ledger): capacity may have freed, e.g.
        #: for the admission queue (`coordinator/flow_gate.py`).
        self.on_any_release: Callable[[], object] | None = None
        self.lifetime_s = lifetime_s
        self.grace_s = grace_s
        self.stale_s = stale_s
        self.clock = clock
        self.incarnation = incarnation or os.urandom(4).hex()
        self.counters = TicketCounters()
        self._tickets: dict[str, Ticket] = {}
        self._by_request: dict[str, Ticket] = {}  # the newest outstanding ticket per request id
        self._numbers = itertools.count(1)
        self._streams = 0  # ALS streams connected now

    def __len__(self) -> int:
        return len(self._tickets)

    def __contains__(self, ticket_id: str) -> bool:
        return ticket_id in self._tickets

    def get(self, ticket_id: str) -> Ticket | None:
        return self._tickets.get(ticket_id)

    def issue(
        self,
        commitments: Iterable[Commitment],
        request_id: str = "",
        on_end: Callable[[], object] | None = None,
    ) -> Ticket:
        """A new outstanding ticket holding `commitments` (already committed to the ledger)."""
        now = self.clock()
        ticket = Ticket(
            f"{self.incarnation}-{next(self._numbers)}",
            list(commitments),
            request_id,
            now,
            now + self.lifetime_s,
            on_end,
            unconfirmed=self._streams == 0,
        )
        self._tickets[ticket.id] = ticket
        if request_id:
            self._by_request[request_id] = ticket
        return ticket

    def routed(self, ticket: Ticket) -> None:
        """The decision left for Envoy: from now on only Envoy's log (or expiry, or reconcile) ends the ticket."""
        ticket.routed_at = self.clock() or 1e-9

    def abort(self, ticket: Ticket) -> bool:
        """The decision never reached Envoy (an error, or the request went away while it was being made):
        releases now. Does nothing once routed or ended; True when it released."""
        if ticket.routed:
            return False
        return self._end(ticket, ABORTED)

    def end(self, ticket_id: str, reason: str = COMPLETED, response_bytes: int | None = None) -> bool:
        """Envoy logged the end of the ticket's request (with its response body's size); True the first time
        only."""
        ticket = self._tickets.get(ticket_id)
        if ticket is None:
            self.counters.unknown += 1
            return False
        ticket.response_bytes = response_bytes
        return self._end(ticket, reason)

    def ended_without_ticket(self, request_id: str) -> bool:
        """Envoy logged the end of request `request_id` without a ticket: a decision for it may have been
        written but dropped by Envoy (the request ended first). Its ticket, if any, becomes unconfirmed, for
        `reconcile` to release once its engines are idle. True when there was one."""
        ticket = self._by_request.get(request_id)
        if ticket is None:
            return False
        ticket.unconfirmed = True
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Ends every ticket past its lifetime; returns their ids."""
        now = self.clock() if now is None else now
        due = [t for t in self._tickets.values() if t.expires_at <= now]
        for ticket in due:
            self._end(ticket, EXPIRED)
        return [t.id for t in due]

    def stream_opened(self) -> None:
        """An ALS stream connected."""
        self._streams += 1

    def stream_closed(self) -> None:
        """An ALS stream ended: the entries it would have carried are lost (Envoy died, or its connection broke),
        and which tickets they were is unknown, since each Envoy worker logs on a stream of its own and a
        restarted Envoy may connect its new streams before the old ones are seen closing: every outstanding
        ticket becomes unconfirmed (`reconcile` ends only those whose engines then report idle; the others still
        end by their entries)."""
        self._streams = max(0, self._streams - 1)
        for ticket in self._tickets.values():
            ticket.unconfirmed = True

    @property
    def streams(self) -> int:
        """ALS streams connected now."""
        return self._streams

    def reconcile(self, loads: Mapping[str, EngineSample]) -> list[str]:
        """Ends routed tickets whose engines all report nothing running or waiting, in a sample taken at least
        `grace_s` after the decision left for an unconfirmed ticket, `stale_s` for any other (an entry can also
        be lost while streams are up: Envoy killed after its successor connected, or the entry dropped by Envoy;
        an engine idle that long after the request left is not serving it). An engine this replica has no sample of
        (deregistered, or its heartbeats reach another replica) counts as idle `stale_s` after the decision left.
        A decision still being made, say during a handoff prefill leg, is never reconciled. Returns their ids."""
        done = []
        now = self.clock()
        for ticket in list(self._tickets.values()):
            if not ticket.routed or not ticket.commitments:
                continue
            settled = ticket.routed_at + (self.grace_s if ticket.unconfirmed else self.stale_s)
            unheard = now - ticket.routed_at >= self.stale_s  # long enough to give up on a sample here
            idle = True
            for iid in ticket.instance_ids:
                load = loads.get(iid)
                if load is None or not load.sampled_at:  # gone, or never sampled by this replica
                    if unheard:
                        continue
                    idle = False
                    break
                if load.sampled_at < settled or load.running or load.waiting:
                    idle = False
                    break
            if idle:
                self._end(ticket, RECONCILED)
                done.append(ticket.id)
        return done

    def _end(self, ticket: Ticket, reason: str) -> bool:
        if ticket.ended:
            return False
        ticket.ended = reason
        del self._tickets[ticket.id]
        if self._by_request.get(ticket.request_id) is ticket:
            del self._by_request[ticket.request_id]
        self.counters.ended[reason] += 1
        try:
            if ticket.on_end is not None:
                ticket.on_end()
        finally:
            try:
                for commitment in ticket.commitments:
                    self.ledger.release(commitment)
            finally:
                try:
                    if ticket.on_release is not None:
                        ticket.on_release(ticket)
                finally:
                    if self.on_any_release is not None:
                        self.on_any_release()
        return True
