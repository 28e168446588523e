"""Envoy ext_proc shell around the decision core (`envoy.service.ext_proc.v3.ExternalProcessor`).

One message each way per routed request. Envoy's ingress runs ext_proc with request headers SKIP and request body
BUFFERED, followed by a `buffer` filter that holds the request until the body has been processed, so routing
waits for the decision. Envoy sends one message, the buffered body, with the attributes `request.path`,
`request.method`, `request.id` (the `x-request-id` Envoy keeps or generates: the client's id) and the
`authorization` header (for the API key check; absent when the client sent none). The coordinator answers with:
- dynamic metadata in the `tandem` namespace: `destination` (`host:port`, read by the ORIGINAL_DST cluster's
  `metadata_key`), `request_id` (the id the coordinator minted, set as the upstream `x-request-id` by the route),
  `client_request_id` (set as `x-tandem-client-request-id` by the route and echoed to the client as its
  `x-request-id`) and `ticket` (logged by Envoy's access log when the request ends: that is how the workload is
  released, `coordinator/access_log.py`);
- in P/D modes, the rewritten body (Envoy fixes `content-length`);
- or an immediate OpenAI-style error (401 without a valid API key).
Then the coordinator closes the stream: Envoy waits on nothing more from it, and a coordinator that dies later cuts
no request it routed. A handoff reply still waiting for its prefill leg at half of Envoy's message timeout is
preceded by a timer extension, never sooner: the first message carries the stream's response headers, and with
coordinator replicas Envoy opens a stream whose replica died again on another one (with the body it kept) only
before those. Requests outside the routed paths (`/v1/models`, health, wrong method or path) reach a route
that sends their headers instead (the body is not needed), answered at once.

The engine must not get the API key either: Envoy does not apply a header mutation sent with the body when the
headers were skipped (seen with Envoy 1.40), so the routed routes remove `authorization` themselves in a mesh with
API keys (`envoy/envoy.yaml.j2`); `Routed.remove_headers` is applied by ext_authz only.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.duration_pb2 import Duration

from coordinator.access_log import METADATA_NAMESPACE, TICKET_KEY
from coordinator.decision import Answer, Decider, Routed, new_request_ids
from coordinator.errors import OpenAIError
from tandem import tracing
from tandem.logs import request_id_var

log = logging.getLogger(__name__)

#: The namespace ext_proc puts request attributes under in `ProcessingRequest.attributes`.
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
#: The attribute carrying the request's Authorization header: a CEL expression, evaluated by Envoy (left out when
#: the header is absent).
AUTHORIZATION_ATTRIBUTE = "request.headers['authorization']"
#: Attributes Envoy sends with the body (the filter's `request_attributes`, rendered from this).
REQUEST_ATTRIBUTES = ("request.path", "request.method", "request.id", AUTHORIZATION_ATTRIBUTE)
_SET = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_JSON = base_pb2.HeaderValueOption(
    header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"), append_action=_SET
)
#: Response headers the ext_proc routes copy from the decision's dynamic metadata (same key) onto the engine's
#: reply: a tenant's quota (`coordinator/quotas.py`); Envoy leaves out a header whose value is empty.
RESPONSE_HEADER_KEYS = tuple(
    f"x-ratelimit-{what}-{kind}"
    for kind in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
)
_CONTINUE_BODY = ep.ProcessingResponse(request_body=ep.BodyResponse())


def _text(header: base_pb2.HeaderValue) -> str:
    """A header's value (Envoy sends `raw_value`; older versions `value`)."""
    return header.raw_value.decode("latin-1") if header.raw_value else header.value


def immediate(answer: Answer) -> ep.ProcessingResponse:
    """An answer Envoy sends to the client instead of forwarding the request."""
    extra = [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_SET
        )
        for k, v in answer.headers
    ]
    headers = (
        ep.HeaderMutation(set_headers=([_JSON] if answer.body else []) + extra)
        if answer.body or extra
        else None
    )
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=answer.status),
            headers=headers,
            body=answer.body,
            details=answer.details,
        )
    )


def routed_response(routed: Routed) -> ep.ProcessingResponse:
    """The body reply of a routed request: the decision as dynamic metadata, and the new body if any."""
    metadata = struct_pb2.Struct()
    fields = metadata.fields[METADATA_NAMESPACE].struct_value.fields
    fields["destination"].string_value = routed.destination
    fields["request_id"].string_value = routed.request_id
    fields["client_request_id"].string_value = routed.client_request_id
    fields[TICKET_KEY].string_value = routed.ticket.id
    for key, value in routed.response_headers:
        fields[key].string_value = value
    response = ep.BodyResponse()
    if routed.body is not None:
        response.response.body_mutation.body = routed.body
    return ep.ProcessingResponse(request_body=response, dynamic_metadata=metadata)


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """One exchange per stream; see the module doc. `decision_timeout_s` is Envoy's message timeout
    (`envoy.ext_proc_timeout_ms`): a handoff reply still being decided at half of it extends it to
    `prefill_budget_s`."""

    def __init__(self, decider: Decider, prefill_budget_s: float, decision_timeout_s: float = 5.0) -> None:
        self.decider = decider
        budget = Duration()
        budget.FromMilliseconds(int(prefill_budget_s * 1000))
        self._extend_timeout = ep.ProcessingResponse(override_message_timeout=budget)
        self._extend_after_s = decision_timeout_s / 2

    async def Process(self, request_iterator, context) -> None:
        # The read/write API rather than a generator: the handoff's timer extension must leave while the
        # prefill leg runs, before the decision.
        message = await context.read()
        if message is grpc.aio.EOF:
            return
        kind = message.WhichOneof("request")
        if kind == "request_body":
            await self._on_body(message, context)
        elif kind == "request_headers":
            await context.write(self._on_headers(message.request_headers))
        # One exchange: returning closes the stream, and Envoy goes on without the coordinator.

    def _on_headers(self, headers: ep.HttpHeaders) -> ep.ProcessingResponse:
        """A request on the headers-only route (not a routed path): answered at once."""
        method = path = ""
        client_id = authorization = None
        for h in headers.headers.headers:
            key = h.key
            if key == ":path":
                path = _text(h).split("?", 1)[0]
            elif key == ":method":
                method = _text(h)
            elif key == "x-request-id":
                client_id = _text(h)
            elif key == "authorization":
                authorization = _text(h)
        request_id_var.set(new_request_ids(client_id).log)
        answer = self.decider.without_body(method, path, authorization)
        if answer is None:  # a routed path whose route sent headers: a body-less request
            answer = self.decider.reject(
                OpenAIError(400, "The request body is empty; expected a JSON object.")
            )
        return immediate(answer)

    async def _on_body(self, message: ep.ProcessingRequest, context) -> None:
        attributes = message.attributes.get(ATTRIBUTES_NAMESPACE)
        fields = attributes.fields if attributes is not None else {}
        path = fields["request.path"].string_value.split("?", 1)[0] if "request.path" in fields else ""
        method = fields["request.method"].string_value if "request.method" in fields else "POST"
        ids = new_request_ids(fields["request.id"].string_value if "request.id" in fields else None)
        request_id_var.set(ids.log)
        auth = fields.get(AUTHORIZATION_ATTRIBUTE)
        authorization = auth.string_value if auth is not None else None
        answer = self.decider.without_body(method, path, authorization)
        if answer is not None:
            await context.write(immediate(answer))
            return

        # The timer extension leaves only if the reply is late (a prefill leg still running at half of Envoy's
        # timer). Sent at once, it would be the stream's first message, with its response headers, and Envoy
        # retries a stream on another coordinator replica only before those: a replica killed during a short
        # leg would fail the request instead of having it decided again.
        writing = asyncio.Lock()  # the reply never interleaves with the extension
        extension: asyncio.Task | None = None
        extend_at = asyncio.get_running_loop().time() + self._extend_after_s

        async def extend_later() -> None:
            await asyncio.sleep(extend_at - asyncio.get_running_loop().time())
            async with writing:
                try:
                    await context.write(self._extend_timeout)
                except Exception:  # the stream is gone: the reply's write finds out too
                    log.debug("timer extension not sent", exc_info=True)

        async def extend() -> None:
            nonlocal extension
            extension = asyncio.create_task(extend_later())

        try:
            trace = tracing.metadata_context(context.invocation_metadata()) if tracing.ENABLED else None
            outcome = await self.decider.route(
                path, message.request_body.body, ids, extend, authorization, trace
            )
        except BaseException:
            if extension is not None:
                extension.cancel()
            raise
        async with writing:
            if extension is not None:
                extension.cancel()  # not written yet (or already written): the reply follows
            if isinstance(outcome, Answer):
                await context.write(immediate(outcome))
                return
            tickets = self.decider.tickets
            try:
                await context.write(routed_response(outcome))
            except BaseException:  # the stream is gone: the decision never reached Envoy
                tickets.abort(outcome.ticket)
                raise
            tickets.routed(outcome.ticket)
