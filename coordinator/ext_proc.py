"""Envoy ext_proc shell around the endpoint picker (`envoy.service.ext_proc.v3.ExternalProcessor`).

One gRPC stream per HTTP request. Envoy sends the request headers, then the buffered body; the coordinator
answers the body with the destination header (read by Envoy's ORIGINAL_DST cluster) and `X-Request-Id`, or with
an immediate OpenAI-style error. Responses never pass through here: Envoy streams them from the engine. Envoy ends
the stream when the HTTP stream ends (completed, failed or cut by the client), which is when the request's
workload is released.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf.duration_pb2 import Duration

from coordinator import metrics
from coordinator.api_keys import ApiKeys
from coordinator.attempts import Attempt
from coordinator.errors import OpenAIError
from coordinator.handoff import HandoffRunner
from coordinator.openai_request import ROUTED_PATHS
from coordinator.picker import HANDOFF, TRIGGER, Decision, EndpointPicker
from coordinator.request_ids import CLIENT_ID_HEADER, client_request_id, log_id, mint_request_id
from coordinator.trigger import TriggerCoordinator
from tandem.logs import request_id_var

log = logging.getLogger(__name__)

#: The header Envoy's ORIGINAL_DST cluster reads the upstream `host:port` from. Clients never set it: the
#: coordinator removes it from every request and sets it itself.
DESTINATION_HEADER = "x-tandem-destination"
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


_CONTINUE_HEADERS = ep.ProcessingResponse(
    request_headers=ep.HeadersResponse(
        response=ep.CommonResponse(header_mutation=ep.HeaderMutation(remove_headers=[DESTINATION_HEADER]))
    )
)
_CONTINUE_RESPONSE_HEADERS = ep.ProcessingResponse(response_headers=ep.HeadersResponse())
_CONTINUE_RESPONSE_BODY = ep.ProcessingResponse(response_body=ep.BodyResponse())
_CONTINUE_REQUEST_TRAILERS = ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
_CONTINUE_RESPONSE_TRAILERS = ep.ProcessingResponse(response_trailers=ep.TrailersResponse())


def _text(header: base_pb2.HeaderValue) -> str:
    """A header's value (Envoy sends `raw_value`; older versions `value`)."""
    return header.raw_value.decode("latin-1") if header.raw_value else header.value


def immediate(status: int, body: bytes, details: str) -> ep.ProcessingResponse:
    """An answer Envoy sends to the client instead of forwarding the request."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ep.HeaderMutation(set_headers=[_header("content-type", "application/json")]),
            body=body,
            details=details,
        )
    )


UNAUTHORIZED = OpenAIError(
    401, "Missing or incorrect API key: send `Authorization: Bearer <key>`.", code="invalid_api_key"
)


def error_response(error: OpenAIError) -> ep.ProcessingResponse:
    """An OpenAI-style JSON error answered by Envoy on the coordinator's behalf."""
    return immediate(error.status, error.body(), f"tandem_{error.status}")


@dataclass(slots=True)
class RequestCounters:
    """Requests this process routed or answered with an error since it started (for Admin.GetStats)."""

    routed: int = 0
    rejected: int = 0


class _Stream:
    """Per-HTTP-request state: small and typed."""

    __slots__ = ("path", "api", "request_id", "client_request_id", "decision", "attempt")

    def __init__(self) -> None:
        self.path = ""
        self.api: str | None = None
        self.request_id = ""  # minted by the coordinator: what engines, attempts and callbacks see
        self.client_request_id = ""  # the client's X-Request-Id: logs and the echo only
        self.decision: Decision | None = None
        self.attempt: Attempt | None = None


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """Routes OpenAI requests; answers `/v1/models` and errors itself."""

    def __init__(
        self,
        picker: EndpointPicker,
        handoff: HandoffRunner,
        trigger: TriggerCoordinator,
        prefill_budget_s: float,
        api_keys: ApiKeys | None = None,
    ) -> None:
        self.api_keys = api_keys or ApiKeys()
        self.picker = picker
        self.handoff = handoff
        self.trigger = trigger
        self.counters = RequestCounters()
        budget = Duration()
        budget.FromMilliseconds(int(prefill_budget_s * 1000))
        self._extend_timeout = ep.ProcessingResponse(override_message_timeout=budget)

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context
    ) -> AsyncIterator[ep.ProcessingResponse]:
        stream = _Stream()
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("request")
                if kind == "request_headers":
                    yield self._on_headers(stream, message.request_headers)
                elif kind == "request_body":
                    async for reply in self._on_body(stream, message.request_body):
                        yield reply
                elif kind == "response_headers":
                    yield _CONTINUE_RESPONSE_HEADERS
                elif kind == "response_body":
                    yield _CONTINUE_RESPONSE_BODY
                elif kind == "request_trailers":
                    yield _CONTINUE_REQUEST_TRAILERS
                elif kind == "response_trailers":
                    yield _CONTINUE_RESPONSE_TRAILERS
        finally:
            # Completed, failed, or cut by the client: Envoy ended the stream, the request holds nothing more.
            try:
                if stream.attempt is not None:  # trigger mode: cancels a prefill leg still in flight
                    self.trigger.registry.close(stream.attempt)
            finally:  # whatever happened above, the workload is released
                decision = stream.decision
                if decision is not None and self.picker.release(decision.target):
                    metrics.INFLIGHT.dec()

    def _on_headers(self, stream: _Stream, headers: ep.HttpHeaders) -> ep.ProcessingResponse:
        method = ""
        authorization = None
        for h in headers.headers.headers:
            key = h.key
            if key == ":path":
                stream.path = _text(h).split("?", 1)[0]
            elif key == ":method":
                method = _text(h)
            elif key == "x-request-id":
                stream.client_request_id = client_request_id(_text(h))
            elif key == "authorization":
                authorization = _text(h)
        stream.request_id = mint_request_id()  # never the client's: duplicates must not meet inside the mesh
        request_id_var.set(log_id(stream.client_request_id, stream.request_id))
        if stream.path.startswith("/v1/") and not self.api_keys.accepts(authorization):
            return self._reject(UNAUTHORIZED)
        api = ROUTED_PATHS.get(stream.path)
        if api is not None:
            if method != "POST":
                return self._reject(OpenAIError(405, f"Use POST for {stream.path}."))
            if headers.end_of_stream:
                return self._reject(OpenAIError(400, "The request body is empty; expected a JSON object."))
            stream.api = api
            return _CONTINUE_HEADERS
        if stream.path == "/v1/models" and method == "GET":
            return self._models()
        if stream.path in ("/health", "/ping") and method == "GET":
            return immediate(200, b"", "tandem_health")
        return self._reject(OpenAIError(404, f"Tandem does not route {method} {stream.path}."))

    async def _on_body(self, stream: _Stream, body: ep.HttpBody) -> AsyncIterator[ep.ProcessingResponse]:
        if stream.api is None:  # a body after an immediate answer: nothing to do
            yield ep.ProcessingResponse(request_body=ep.BodyResponse())
            return
        start = time.perf_counter()
        try:
            decision = await self.picker.decide(stream.api, body.body, stream.request_id)
        except OpenAIError as exc:
            yield self._reject(exc)
            return
        except Exception:
            log.exception("routing failed")
            yield self._reject(OpenAIError(500, "The coordinator failed to route this request; see its log."))
            return
        # Registered on the stream at once: from here on, the stream's end releases the workload.
        stream.decision = decision
        instance = decision.target.instance.info
        self.counters.routed += 1
        metrics.INFLIGHT.inc()
        metrics.routed(instance.instance_id)
        metrics.DECISION_SECONDS.observe(time.perf_counter() - start)
        new_body = None
        engine_request_id = stream.request_id
        if decision.mode == TRIGGER:
            stream.attempt, new_body = self.trigger.open(decision, stream.path)
            engine_request_id = stream.attempt.engine_request_id
        elif decision.mode == HANDOFF:
            # Envoy waits for this reply while the prefill leg runs: extend its message timer first.
            yield self._extend_timeout
            try:
                new_body = await self.handoff.run(decision, stream.path)
            except OpenAIError as exc:
                yield self._reject(exc)
                return
        if log.isEnabledFor(logging.DEBUG):
            log.debug("routed", extra={"instance": instance.instance_id, "mode": decision.mode})
        headers = [
            _header(DESTINATION_HEADER, instance.address),
            _header("x-request-id", engine_request_id),
            _header(CLIENT_ID_HEADER, stream.client_request_id or stream.request_id),
        ]
        mutation = None
        if new_body is not None:
            headers.append(_header("content-length", str(len(new_body))))
            mutation = ep.BodyMutation(body=new_body)
        # The mesh's API key is not the engine's business.
        removed = ["authorization"] if self.api_keys.enabled else []
        common = ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=headers, remove_headers=removed),
            body_mutation=mutation,
            clear_route_cache=True,
        )
        yield ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))

    def _reject(self, error: OpenAIError) -> ep.ProcessingResponse:
        self.counters.rejected += 1
        metrics.REJECTED.labels(str(error.status)).inc()
        log.info("rejected", extra={"status": error.status, "reason": error.message})
        return error_response(error)

    def _models(self) -> ep.ProcessingResponse:
        now = int(time.time())
        data = [
            {"id": m, "object": "model", "created": now, "owned_by": "tandem"}
            for m in self.picker.instances.routable_models()
        ]
        return immediate(200, json.dumps({"object": "list", "data": data}).encode(), "tandem_models")
