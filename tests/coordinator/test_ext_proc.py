"""The ext_proc shell, driven with the messages Envoy sends (no Envoy needed; the e2e tests use a real one)."""

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from coordinator.attempts import AttemptRegistry
from coordinator.ext_proc import DESTINATION_HEADER, ExternalProcessor
from coordinator.handoff import HandoffRunner
from coordinator.trigger import TriggerCoordinator
from tests.helpers import make_picker, pd_picker

URL = "http://127.0.0.1:9000/v1/metaserver/c0"


def headers(
    path: str, method: str = "POST", end_of_stream: bool = False, **extra: str
) -> ep.ProcessingRequest:
    pairs = {":path": path, ":method": method, **{k.replace("_", "-"): v for k, v in extra.items()}}
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    )
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=end_of_stream))


def body(payload) -> ep.ProcessingRequest:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=True))


async def exchange(processor: ExternalProcessor, *messages: ep.ProcessingRequest, keep_open: bool = False):
    """Runs one stream; returns the replies and, when `keep_open`, the generator (the HTTP stream still open)."""

    async def requests():
        for m in messages:
            yield m

    stream = processor.Process(requests(), None)
    replies = [await stream.__anext__() for _ in messages]
    if keep_open:
        return replies, stream
    async for _ in stream:
        pass
    return replies


def processor_for(picker) -> ExternalProcessor:
    runner = HandoffRunner(picker, 5.0, 2)
    return ExternalProcessor(picker, runner, TriggerCoordinator(runner, AttemptRegistry(), URL), 15.0)


def set_headers(reply: ep.ProcessingResponse) -> dict[str, str]:
    mutation = reply.request_body.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


async def test_routes_and_releases_when_envoy_ends_the_stream():
    picker = make_picker()
    processor = processor_for(picker)
    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    (h, b), stream = await exchange(
        processor, headers("/v1/chat/completions", x_request_id="abc"), body(req), keep_open=True
    )
    assert (
        DESTINATION_HEADER in h.request_headers.response.header_mutation.remove_headers
    )  # clients cannot choose
    routed = set_headers(b)
    assert routed[DESTINATION_HEADER] in {"127.0.0.1:8100", "127.0.0.1:8101"}
    # The engine sees an id the coordinator minted; the client's is kept for the echo.
    assert routed["x-request-id"].startswith("tdm-") and routed["x-tandem-client-request-id"] == "abc"
    assert b.request_body.response.clear_route_cache
    assert picker.ledger.total_requests == 1 and picker.ledger.total_tokens > 8
    await stream.aclose()  # Envoy ends the stream when the HTTP stream ends (completed or cut)
    assert picker.ledger.total_requests == 0 and picker.ledger.total_tokens == 0
    assert processor.counters.routed == 1


async def test_request_id_is_generated_when_absent():
    processor = processor_for(make_picker())
    _, b = await exchange(processor, headers("/v1/completions"), body({"model": "m", "prompt": "x"}))
    assert len(set_headers(b)["x-request-id"]) == 28 and set_headers(b)["x-request-id"].startswith("tdm-")


async def test_errors_are_immediate_openai_json():
    processor = processor_for(make_picker())
    _, bad = await exchange(processor, headers("/v1/completions"), body(b"{oops"))
    assert bad.immediate_response.status.code == 400
    assert json.loads(bad.immediate_response.body)["error"]["code"] == 400
    _, unknown = await exchange(processor, headers("/v1/completions"), body({"model": "x", "prompt": "p"}))
    assert unknown.immediate_response.status.code == 404
    (no_body,) = await exchange(processor, headers("/v1/completions", end_of_stream=True))
    assert no_body.immediate_response.status.code == 400
    (get,) = await exchange(processor, headers("/v1/completions", method="GET", end_of_stream=True))
    assert get.immediate_response.status.code == 405
    (other,) = await exchange(processor, headers("/v1/embeddings"))
    assert other.immediate_response.status.code == 404
    assert processor.counters.rejected == 5 and processor.picker.ledger.total_requests == 0


async def test_models_lists_routable_models():
    processor = processor_for(make_picker())
    (reply,) = await exchange(processor, headers("/v1/models", method="GET", end_of_stream=True))
    listed = json.loads(reply.immediate_response.body)
    assert reply.immediate_response.status.code == 200
    assert [m["id"] for m in listed["data"]] == ["m"] and listed["object"] == "list"


async def test_client_gone_during_prefill_leg_releases_everything():
    import asyncio

    from aiohttp import web

    started, done = asyncio.Event(), asyncio.Event()

    async def slow(request):
        started.set()
        await done.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    picker = pd_picker([f"127.0.0.1:{port}"])
    processor = processor_for(picker)

    async def requests():
        yield headers("/v1/completions")
        yield body({"model": "m", "prompt": "hello", "stream": True})
        await asyncio.Event().wait()  # the client keeps the stream open until Envoy cancels it

    async def consume():
        async for _ in processor.Process(requests(), None):
            pass

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 5)
    assert picker.ledger.total_requests == 2  # decode leg and prefill leg
    task.cancel()  # Envoy ends the stream: the client went away
    await asyncio.gather(task, return_exceptions=True)
    assert picker.ledger.total_requests == 0 and picker.ledger.total_tokens == 0
    done.set()
    await processor.handoff.close()
    await runner.cleanup()
