"""Envoy ext_authz shell around the decision core (`envoy.service.auth.v3.Authorization`): one unary `Check`
per request, the cheapest of Envoy's typed decision calls (docs/benchmarks.md), for meshes that serve aggregated
models only (it cannot rewrite the body, which P/D modes need; those meshes run `ext_proc.py`).

Envoy buffers the body (`with_request_body`, packed as bytes) and sends it with the request's path, method and
headers. An allowed request gets the destination header (read by the ORIGINAL_DST cluster), `x-request-id` (the
id the coordinator minted), `x-tandem-client-request-id` (the client's id, which the route echoes back), the
headers to remove (the API key) and the ticket as dynamic metadata (logged by Envoy's access log when the request
ends, which releases its workload); Envoy clears its route cache and forwards. Anything else is denied with the
coordinator's answer as the local reply: OpenAI-style errors (401 without a valid API key), `/v1/models`,
health.
"""

from __future__ import annotations

import logging

from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import external_auth_pb2 as ea
from envoy.service.auth.v3 import external_auth_pb2_grpc as ea_grpc
from envoy.type.v3 import http_status_pb2
from google.rpc import code_pb2, status_pb2

from coordinator.access_log import TICKET_KEY
from coordinator.decision import Answer, Decider, Routed, new_request_ids
from coordinator.request_ids import CLIENT_ID_HEADER
from tandem import tracing
from tandem.logs import request_id_var

log = logging.getLogger(__name__)

#: The header Envoy's ORIGINAL_DST cluster reads the upstream `host:port` from on this path. The coordinator
#: overwrites it on every allowed request: a client never chooses the upstream.
DESTINATION_HEADER = "x-tandem-destination"
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_DENIED = status_pb2.Status(code=code_pb2.PERMISSION_DENIED)


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # ext_authz applies `value` (a `raw_value` arrives empty upstream).
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, value=value), append_action=_OVERWRITE
    )


_JSON = _header("content-type", "application/json")


def denied(answer: Answer) -> ea.CheckResponse:
    """The coordinator's own answer, sent by Envoy as the local reply."""
    return ea.CheckResponse(
        status=_DENIED,
        denied_response=ea.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=answer.status),
            headers=([_JSON] if answer.body else []) + [_header(k, v) for k, v in answer.headers],
            body=answer.body.decode(),
        ),
    )


class Authorization(ea_grpc.AuthorizationServicer):
    """One `Check` per request; see the module doc."""

    def __init__(self, decider: Decider) -> None:
        self.decider = decider
        self._destinations: dict[str, base_pb2.HeaderValueOption] = {}  # by engine address

    async def Check(self, request: ea.CheckRequest, context) -> ea.CheckResponse:
        http = request.attributes.request.http
        path = http.path.split("?", 1)[0]
        headers = http.headers  # lower-case names
        ids = new_request_ids(headers.get("x-request-id") or http.id)
        request_id_var.set(ids.log)
        answer = self.decider.without_body(http.method, path, headers.get("authorization"))
        if answer is not None:
            return denied(answer)
        body = http.raw_body or http.body.encode()
        trace = tracing.metadata_context(context.invocation_metadata()) if tracing.ENABLED else None
        outcome = await self.decider.route(
            path, body, ids, authorization=headers.get("authorization"), trace=trace
        )
        if isinstance(outcome, Answer):
            return denied(outcome)
        # Returned, not written: past this point the reply is grpc's to deliver. Should Envoy drop it (the client
        # left first), Envoy's log of the request carries no ticket and `ended_without_ticket` flags it.
        self.decider.tickets.routed(outcome.ticket)
        return self._allowed(outcome)

    def _allowed(self, routed: Routed) -> ea.CheckResponse:
        # Filled in place, the destination header reused per engine: building these messages from keyword
        # arguments cost more than twice as much (per request, on the coordinator's one core).
        reply = ea.CheckResponse()
        reply.status.code = code_pb2.OK
        ok = reply.ok_response
        headers = ok.headers
        destination = routed.destination
        if routed.fallback is not None:  # the `static` engines cluster tries the listed addresses in order
            destination = f"{destination},{routed.fallback}"
        dest = self._destinations.get(destination)
        if dest is None:
            dest = self._destinations[destination] = _header(DESTINATION_HEADER, destination)
        headers.append(dest)
        for key, value in (("x-request-id", routed.request_id), (CLIENT_ID_HEADER, routed.client_request_id)):
            header = headers.add()
            header.header.key = key
            header.header.value = value
            header.append_action = _OVERWRITE
        ok.headers_to_remove.extend(routed.remove_headers)
        for key, value in routed.response_headers:  # the tenant's x-ratelimit-*, on the engine's reply
            header = ok.response_headers_to_add.add()
            header.header.key = key
            header.header.value = value
            header.append_action = _OVERWRITE
        reply.dynamic_metadata.fields[TICKET_KEY].string_value = routed.ticket.id
        return reply
