"""The access log service turns Envoy's entries into ticket ends (entries built as Envoy sends them)."""

from envoy.data.accesslog.v3 import accesslog_pb2 as al
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import struct_pb2

from coordinator.access_log import AccessLogService, outcome_of, ticket_of
from coordinator.tickets import CLIENT_GONE, COMPLETED, FAILED, TicketTable
from coordinator.workload import WorkloadLedger


def entry(
    namespace: str = "", ticket: str = "", code: int = 200, client_gone: bool = False, request_id: str = ""
):
    e = al.HTTPAccessLogEntry()
    if namespace:
        fields = struct_pb2.Struct()
        fields.update({"ticket": ticket})
        e.common_properties.metadata.filter_metadata[namespace].CopyFrom(fields)
    e.common_properties.response_flags.downstream_connection_termination = client_gone
    e.response.response_code.value = code
    e.request.request_id = request_id
    return e


def test_ticket_and_outcome_from_either_decision_filter():
    assert ticket_of(entry("tandem", "t1")) == "t1"
    assert ticket_of(entry("envoy.filters.http.ext_authz", "t2")) == "t2"
    assert ticket_of(entry("some.other.filter", "t3")) == "" and ticket_of(entry()) == ""
    assert outcome_of(entry(code=200)) == COMPLETED
    assert outcome_of(entry(code=200, client_gone=True)) == CLIENT_GONE
    assert outcome_of(entry(code=503)) == FAILED and outcome_of(entry(code=0)) == FAILED


async def test_stream_ends_tickets_and_tracks_the_connection():
    ledger = WorkloadLedger()
    table = TicketTable(ledger, 60.0, incarnation="x")
    routed = table.issue([ledger.commit("i0", 3, 4)], "r1")
    table.routed(routed)
    dropped = table.issue([ledger.commit("i1", 3, 4)], "r2")
    table.routed(dropped)
    service = AccessLogService(table)
    seen_streams = []

    async def messages():
        seen_streams.append(table.streams)
        batch = als_pb2.StreamAccessLogsMessage()
        batch.http_logs.log_entry.extend(
            [
                entry("tandem", routed.id, client_gone=True),
                entry("tandem", routed.id),  # a duplicate
                entry(request_id="r2"),  # the decision of r2 was dropped by Envoy
                entry("tandem", "someone-elses-ticket"),
            ]
        )
        yield batch

    await service.StreamAccessLogs(messages(), None)
    assert seen_streams == [1] and table.streams == 0
    assert routed.ended == CLIENT_GONE and ledger.requests("i0") == 0
    assert dropped.unconfirmed and not dropped.ended  # left to reconcile with the engine's load
    assert table.counters.unknown == 2
