"""Envoy's gRPC access log stream (`envoy.service.accesslog.v3.AccessLogService`): how the coordinator learns that
a request it routed ended.

Envoy logs every ingress request when its HTTP stream ends (completed, failed, or cut by the client) and sends the
entries in batches on a client stream. The entry carries the ticket the coordinator issued with its decision, in
the dynamic metadata of the filter that made the decision (`tandem.ticket` from ext_proc, `ticket` in ext_authz's
namespace), which a client cannot forge. Entries without a ticket (requests answered by the coordinator or by
Envoy itself) are skipped. The stream only delivers; the ticket table decides (`coordinator/tickets.py`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from coordinator import metrics
from coordinator.routing_quality import Prediction, TtftAttainment, actual_ttft_s
from coordinator.tickets import CLIENT_GONE, COMPLETED, FAILED, TicketTable

log = logging.getLogger(__name__)

#: Dynamic-metadata namespace the ext_proc reply writes the decision into (destination, request id, ticket).
METADATA_NAMESPACE = "tandem"
#: ext_authz leaves the decision's dynamic metadata under its own filter name.
EXT_AUTHZ_NAMESPACE = "envoy.filters.http.ext_authz"
#: Where each decision filter leaves its dynamic metadata: ext_proc under the namespace the reply names,
#: ext_authz under its own filter name.
TICKET_NAMESPACES = (METADATA_NAMESPACE, EXT_AUTHZ_NAMESPACE)
TICKET_KEY = "ticket"


def ticket_of(entry: accesslog_pb2.HTTPAccessLogEntry) -> str:
    """The coordinator's ticket in a log entry, "" when it has none."""
    filter_metadata = entry.common_properties.metadata.filter_metadata
    for namespace in TICKET_NAMESPACES:
        if namespace in filter_metadata:
            value = filter_metadata[namespace].fields.get(TICKET_KEY)
            if value is not None and value.string_value:
                return value.string_value
    return ""


def outcome_of(entry: accesslog_pb2.HTTPAccessLogEntry) -> str:
    """How the request ended: the client went away, Envoy or the engine failed it, or it completed."""
    flags = entry.common_properties.response_flags
    if flags.downstream_connection_termination or flags.downstream_remote_reset:
        return CLIENT_GONE
    code = entry.response.response_code.value
    if code == 0 or code >= 500 or flags.upstream_connection_failure or flags.upstream_remote_reset:
        return FAILED
    return COMPLETED


class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):
    """Ends the ticket named by each HTTP access log entry."""

    def __init__(self, tickets: TicketTable, attainment: TtftAttainment | None = None) -> None:
        self.tickets = tickets
        self.attainment = attainment  # each tier's TTFT objective met, per streamed request

    async def StreamAccessLogs(
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context
    ) -> als_pb2.StreamAccessLogsResponse:
        self.tickets.stream_opened()
        metrics.ALS_STREAMS.inc()
        try:
            async for message in request_iterator:
                for entry in message.http_logs.log_entry:
                    ticket = ticket_of(entry)
                    if ticket:
                        self._observe(ticket, entry)
                        self.tickets.end(ticket, outcome_of(entry), entry.response.response_body_bytes)
                    else:
                        self.tickets.ended_without_ticket(entry.request.request_id)
        finally:
            metrics.ALS_STREAMS.dec()
            self.tickets.stream_closed()
        return als_pb2.StreamAccessLogsResponse()

    def _observe(self, ticket_id: str, entry: accesslog_pb2.HTTPAccessLogEntry) -> None:
        """The routing-quality SLI of a streamed request that completed: its actual TTFT against the prediction."""
        ticket = self.tickets.get(ticket_id)
        prediction = ticket.prediction if ticket is not None else None
        if not isinstance(prediction, Prediction) or not prediction.streamed:
            return
        common = entry.common_properties
        actual = actual_ttft_s(
            common.time_to_first_upstream_tx_byte.ToNanoseconds() / 1e9,
            common.time_to_first_upstream_rx_byte.ToNanoseconds() / 1e9,
        )
        if actual is not None and outcome_of(entry) == COMPLETED:
            metrics.routing_actual_ttft(prediction, actual)
            if self.attainment is not None:
                self.attainment.observe(prediction.tier, actual)
