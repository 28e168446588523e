"""The decision transports (ext_proc body-only exchange, ext_authz Check), driven with the messages Envoy sends
(no Envoy needed; tests/e2e use a real one)."""

import asyncio
import json

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.auth.v3 import attribute_context_pb2 as ac
from envoy.service.auth.v3 import external_auth_pb2 as ea
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from coordinator.access_log import METADATA_NAMESPACE
from coordinator.api_keys import ApiKeys
from coordinator.attempts import AttemptRegistry
from coordinator.decision import Decider
from coordinator.ext_authz import DESTINATION_HEADER, Authorization
from coordinator.ext_proc import ATTRIBUTES_NAMESPACE, AUTHORIZATION_ATTRIBUTE, ExternalProcessor
from coordinator.handoff import HandoffRunner
from coordinator.tickets import TicketTable
from coordinator.trigger import TriggerCoordinator
from coordinator.understand_pool import UnderstandPool
from tests.helpers import eventually, make_picker, pd_picker

URL = "http://127.0.0.1:9000/v1/metaserver/c0"


class FakeStream:
    """The read/write side of one ext_proc stream as grpc.aio gives it to the handler."""

    def __init__(self, *messages: ep.ProcessingRequest, hold: asyncio.Event | None = None) -> None:
        self.incoming = list(messages)
        self.written: list[ep.ProcessingResponse] = []
        self.hold = hold

    async def read(self):
        if self.incoming:
            return self.incoming.pop(0)
        if self.hold is not None:
            await self.hold.wait()
        return grpc.aio.EOF

    async def write(self, message) -> None:
        self.written.append(message)


def body_message(
    payload,
    path: str = "/v1/completions",
    method: str = "POST",
    request_id: str = "abc",
    authorization: str | None = None,
):
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    attributes = struct_pb2.Struct()
    attributes.update({"request.path": path, "request.method": method, "request.id": request_id})
    if authorization is not None:  # Envoy leaves the attribute out when the header is absent
        attributes.update({AUTHORIZATION_ATTRIBUTE: authorization})
    return ep.ProcessingRequest(
        request_body=ep.HttpBody(body=raw, end_of_stream=True), attributes={ATTRIBUTES_NAMESPACE: attributes}
    )


def headers_message(path: str, method: str = "GET", **extra: str) -> ep.ProcessingRequest:
    pairs = {":path": path, ":method": method, **extra}
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=True))


def decider_for(
    picker, pool: UnderstandPool | None = None, inline_bytes: int = 8192, keys: tuple[str, ...] = ()
) -> Decider:
    runner = HandoffRunner(picker, 5.0, 2)
    trigger = TriggerCoordinator(runner, AttemptRegistry(), URL)
    tickets = TicketTable(picker.ledger, 60.0)
    return Decider(picker, runner, trigger, tickets, pool, inline_bytes, ApiKeys(keys))


async def process(decider: Decider, *messages) -> list[ep.ProcessingResponse]:
    stream = FakeStream(*messages)
    await ExternalProcessor(decider, 15.0).Process(None, stream)
    return stream.written


def decision_metadata(reply: ep.ProcessingResponse) -> dict:
    return dict(reply.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.items())


async def test_one_body_message_routes_and_the_ticket_releases():
    picker = make_picker()
    decider = decider_for(picker)
    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    (reply,) = await process(decider, body_message(req, "/v1/chat/completions?x=1"))
    decision = decision_metadata(reply)
    assert decision["destination"] in {"127.0.0.1:8100", "127.0.0.1:8101"}
    # The engine sees an id the coordinator minted; the client's is kept for the echo.
    assert decision["request_id"].startswith("tdm-") and decision["client_request_id"] == "abc"
    assert not reply.request_body.response.HasField("body_mutation")  # aggregated: the client's body as is
    # The stream is closed, the workload still held: the request runs until Envoy logs its end.
    assert picker.ledger.total_requests == 1 and picker.ledger.total_tokens > 8
    ticket = decision["ticket"]
    assert decider.tickets.end(ticket) and not decider.tickets.end(ticket)
    assert picker.ledger.total_requests == 0 and picker.ledger.total_tokens == 0
    assert decider.counters.routed == 1


async def test_errors_and_unrouted_paths_are_answered_at_once():
    decider = decider_for(make_picker())
    (bad,) = await process(decider, body_message(b"{oops"))
    assert bad.immediate_response.status.code == 400
    assert json.loads(bad.immediate_response.body)["error"]["code"] == 400
    (unknown,) = await process(decider, body_message({"model": "x", "prompt": "p"}))
    assert unknown.immediate_response.status.code == 404
    (empty,) = await process(decider, headers_message("/v1/completions", "POST"))
    assert empty.immediate_response.status.code == 400
    (get,) = await process(decider, headers_message("/v1/completions"))
    assert get.immediate_response.status.code == 405
    (other,) = await process(decider, headers_message("/v1/embeddings", "POST"))
    assert other.immediate_response.status.code == 404
    (models,) = await process(decider, headers_message("/v1/models"))
    listed = json.loads(models.immediate_response.body)
    assert [m["id"] for m in listed["data"]] == ["m"] and listed["object"] == "list"
    assert decider.counters.rejected == 5 and decider.picker.ledger.total_requests == 0
    assert len(decider.tickets) == 0


async def test_large_bodies_are_understood_in_a_worker_process_with_the_same_outcome():
    picker = make_picker()
    pool = UnderstandPool(1, {}, picker.config)
    try:
        decider = decider_for(picker, pool, inline_bytes=10)
        (reply,) = await process(decider, body_message({"model": "m", "prompt": "a long prompt " * 50}))
        assert decision_metadata(reply)["destination"]
        request = await pool.understand(
            "completions", json.dumps({"model": "m", "prompt": "a b c"}).encode(), {"m"}
        )
        assert (
            request.prompts == picker.understand("completions", b'{"model": "m", "prompt": "a b c"}').prompts
        )
        (unknown,) = await process(decider, body_message({"model": "nope", "prompt": "x" * 20}))
        assert unknown.immediate_response.status.code == 404  # errors cross the process boundary whole
    finally:
        pool.close()


async def test_ext_authz_check_routes_with_a_header_and_denies_with_openai_json():
    picker = make_picker()
    decider = decider_for(picker)
    authz = Authorization(decider)

    def check(path, method, payload):
        http = ac.AttributeContext.HttpRequest(
            path=path, method=method, headers={"x-request-id": "rid"}, raw_body=payload, id="envoy-id"
        )
        request = ea.CheckRequest(
            attributes=ac.AttributeContext(request=ac.AttributeContext.Request(http=http))
        )
        return authz.Check(request, None)

    ok = await check("/v1/completions", "POST", json.dumps({"model": "m", "prompt": "x"}).encode())
    headers = {h.header.key: h.header.value for h in ok.ok_response.headers}
    assert headers[DESTINATION_HEADER] in {"127.0.0.1:8100", "127.0.0.1:8101"}
    assert headers["x-request-id"].startswith("tdm-") and headers["x-tandem-client-request-id"] == "rid"
    assert not ok.ok_response.headers_to_remove
    ticket = ok.dynamic_metadata.fields["ticket"].string_value
    assert picker.ledger.total_requests == 1
    assert decider.tickets.end(ticket) and picker.ledger.total_requests == 0
    denied = await check("/v1/completions", "POST", b"[]")
    assert denied.denied_response.status.code == 400
    assert json.loads(denied.denied_response.body)["error"]["code"] == 400
    models = await check("/v1/models", "GET", b"")
    assert models.denied_response.status.code == 200
    assert json.loads(models.denied_response.body)["object"] == "list"


async def test_a_late_prefill_leg_extends_envoys_timer_and_a_client_gone_releases_everything():
    from aiohttp import web

    started, done = asyncio.Event(), asyncio.Event()
    legs = 0

    async def prefill(request):
        nonlocal legs
        legs += 1
        if legs > 1:  # the second leg runs until the test lets it go
            started.set()
            await done.wait()
        return web.json_response(
            {"choices": [{"text": "x"}], "kv_transfer_params": {"remote_block_ids": [7]}}
        )

    app = web.Application()
    app.router.add_post("/v1/completions", prefill)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    picker = pd_picker([f"127.0.0.1:{port}"])
    decider = decider_for(picker)
    processor = ExternalProcessor(decider, 15.0, decision_timeout_s=1.0)  # a leg is late after 0.5 s
    payload = {"model": "m", "prompt": "hello", "stream": True}
    # A leg answered in time: the decision is the stream's only message. (The first message carries the stream's
    # response headers, and Envoy retries a stream on another coordinator replica only before those.)
    fast = FakeStream(body_message(payload))
    await processor.Process(None, fast)
    (reply,) = fast.written
    assert json.loads(reply.request_body.response.body_mutation.body)["kv_transfer_params"] == {
        "remote_block_ids": [7]
    }
    assert decider.tickets.end(decision_metadata(reply)["ticket"]) and picker.ledger.total_requests == 0
    # A late leg: the timer extension leaves at half of Envoy's timer, not before.
    stream = FakeStream(body_message(payload))
    task = asyncio.create_task(processor.Process(None, stream))
    await asyncio.wait_for(started.wait(), 5)
    assert picker.ledger.total_requests == 2 and stream.written == []  # decode leg and prefill leg
    await eventually(lambda: stream.written, 5, "the late leg's timer extension")
    assert stream.written[0].HasField("override_message_timeout")
    task.cancel()  # Envoy resets the stream: the client went away
    await asyncio.gather(task, return_exceptions=True)
    assert picker.ledger.total_requests == 0 and picker.ledger.total_tokens == 0
    assert len(decider.tickets) == 0 and decider.tickets.counters.ended["aborted"] == 1
    done.set()
    await decider.handoff.close()
    await runner.cleanup()


async def test_api_keys_on_both_transports_and_the_key_never_reaches_an_engine():
    picker = make_picker()
    decider = decider_for(picker, keys=("sk-good",))
    payload = {"model": "m", "prompt": "x"}
    # ext_proc, body message: the key comes as an attribute.
    (missing,) = await process(decider, body_message(payload))
    (wrong,) = await process(decider, body_message(payload, authorization="Bearer sk-bad"))
    for reply in (missing, wrong):
        assert reply.immediate_response.status.code == 401
        assert json.loads(reply.immediate_response.body)["error"]["code"] == "invalid_api_key"
    (ok,) = await process(decider, body_message(payload, authorization="Bearer sk-good"))
    assert decision_metadata(ok)[
        "destination"
    ]  # (the ext_proc routes remove the key: tests/mesh/test_envoy.py)
    assert decider.tickets.end(decision_metadata(ok)["ticket"])
    # ext_proc, headers-only route: /v1/models needs the key too, health probes do not.
    (models,) = await process(decider, headers_message("/v1/models"))
    assert models.immediate_response.status.code == 401
    (models,) = await process(decider, headers_message("/v1/models", authorization="Bearer sk-good"))
    assert models.immediate_response.status.code == 200
    (health,) = await process(decider, headers_message("/health"))
    assert health.immediate_response.status.code == 200
    # ext_authz: the same answers, the key removed in the OK response.
    authz = Authorization(decider)

    def check(headers: dict[str, str]):
        http = ac.AttributeContext.HttpRequest(
            path="/v1/completions", method="POST", headers=headers, raw_body=json.dumps(payload).encode()
        )
        request = ea.CheckRequest(
            attributes=ac.AttributeContext(request=ac.AttributeContext.Request(http=http))
        )
        return authz.Check(request, None)

    denied = await check({"authorization": "Bearer sk-bad"})
    assert denied.denied_response.status.code == 401
    assert json.loads(denied.denied_response.body)["error"]["type"] == "AuthenticationError"
    allowed = await check({"authorization": "bearer sk-good"})
    assert list(allowed.ok_response.headers_to_remove) == ["authorization"]
    assert decider.tickets.end(allowed.dynamic_metadata.fields["ticket"].string_value)
    assert decider.counters.rejected == 4 and picker.ledger.total_requests == 0


async def test_duplicate_client_ids_get_distinct_engine_ids():
    decider = decider_for(make_picker())
    payload = {"model": "m", "prompt": "x"}
    first, second = [(await process(decider, body_message(payload, request_id="same")))[0] for _ in range(2)]
    ids = [decision_metadata(r)["request_id"] for r in (first, second)]
    assert ids[0] != ids[1] and all(i.startswith("tdm-") for i in ids)
    assert {decision_metadata(r)["client_request_id"] for r in (first, second)} == {"same"}


async def test_limits_hold_inline_and_in_the_worker_process():
    """`check_prompt_size` and the request limits run where the body is understood: a large body goes to the
    worker process, and is refused there before it is tokenized."""
    picker = make_picker()
    picker.max_model_len = {"m": 64}
    pool = UnderstandPool(1, {}, picker.config)
    try:
        for inline_bytes in (1 << 20, 10):  # inline, then in the worker
            decider = decider_for(picker, pool, inline_bytes=inline_bytes)
            huge = {"model": "m", "prompt": "word " * 1000}
            (reply,) = await process(decider, body_message(huge))
            assert reply.immediate_response.status.code == 400
            assert "max_model_len" in json.loads(reply.immediate_response.body)["error"]["message"]
            (reply,) = await process(decider, body_message({"model": "m", "prompt": "x", "n": 10**6}))
            assert json.loads(reply.immediate_response.body)["error"]["param"] == "n"
    finally:
        pool.close()
    assert picker.ledger.total_requests == 0
