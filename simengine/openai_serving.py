"""`/v1/completions` and `/v1/chat/completions` as vLLM's OpenAI server answers them, streamed or not.

The per-token path is kept cheap: the engine loop appends token ids to each sequence and resolves one future per
HTTP request per step; the handler then turns every pending token into an SSE event from prebuilt byte templates
and writes them all with one `write`.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import msgspec
from aiohttp import web

from simengine.engine import Engine
from simengine.protocol import APIError, Params, encode, json_response, parse_params
from simengine.request import Request, SamplingParams, Status
from simengine.sampler import seed_key
from tandem.tokenizer import prompt_token_ids

_decode_json = msgspec.json.Decoder().decode
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"


class _Seq:
    """Output state of one sequence (one choice) as the handler consumes it."""

    __slots__ = ("req", "index", "pending", "text", "held", "finished", "sent_role")

    def __init__(self, req: Request, index: int) -> None:
        self.req = req
        self.index = index
        self.pending: list[int] = []
        self.text: list[str] = []
        self.held = ""  # streamed text held back while it could still become a stop string
        self.finished = False
        self.sent_role = False


class _Group:
    """All sequences of one HTTP request and the future the engine resolves when any has output."""

    __slots__ = ("seqs", "waiter")

    def __init__(self) -> None:
        self.seqs: list[_Seq] = []
        self.waiter: asyncio.Future | None = None


def _on_output(req: Request, tokens: list[int], finished: bool) -> None:
    seq, group = req.user
    seq.pending.extend(tokens)
    if finished:
        seq.finished = True
    w = group.waiter
    if w is not None and not w.done():
        w.set_result(None)


class OpenAIServing:
    """Request handling shared by both APIs; `api` is "completions" or "chat.completions"."""

    def __init__(self, engine: Engine, tokenizer, model_names: list[str], max_model_len: int, connector=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.max_model_len = max_model_len
        self.connector = connector
        self.eos = tokenizer.eos_token_id
        self._text: dict[int, str] = {}
        self._jtext: dict[int, bytes] = {}
        for tid in tokenizer.word_ids:
            self._piece(tid)
        self.num_requests = 0
        cfg = engine.cfg
        self.fault_rng = random.Random(cfg.fault_seed)

    def _piece(self, tid: int) -> bytes:
        j = self._jtext.get(tid)
        if j is None:
            text = "" if tid == self.eos else self.tokenizer.decode([tid])
            self._text[tid] = text
            j = self._jtext[tid] = encode(text)
        return j

    def text_of(self, tokens: list[int]) -> str:
        text = self._text
        return "".join([text[t] if t in text else (self._piece(t) and text[t]) for t in tokens])

    # -- entry ------------------------------------------------------------------------------------------------

    def check_model(self, body: dict) -> str:
        model = body.get("model")
        if model is None:
            return self.model_names[0]
        if model not in self.model_names:
            raise APIError(f"The model `{model}` does not exist.", 404, "model")
        return model

    async def handle(self, request: web.Request, api: str) -> web.StreamResponse:
        cfg = self.engine.cfg
        self.num_requests += 1
        if cfg.fault_crash_after and self.num_requests > cfg.fault_crash_after:
            import os

            os._exit(1)
        try:
            raw = await request.read()
            try:
                body = _decode_json(raw)
            except msgspec.DecodeError as e:
                raise APIError(f"JSON decode error: {e}") from None
            if not isinstance(body, dict):
                raise APIError("request body must be a JSON object")
            model = self.check_model(body)
            chat = api == "chat.completions"
            params = parse_params(body, chat)
            try:
                prompts = prompt_token_ids(self.tokenizer, api, body)
            except ValueError as e:
                raise APIError(str(e)) from None
            if cfg.fault_hang:
                await asyncio.Event().wait()
            if cfg.fault_latency_ms:
                await asyncio.sleep(cfg.fault_latency_ms / 1000.0)
            if cfg.fault_error_rate and self.fault_rng.random() < cfg.fault_error_rate:
                raise APIError("simulated engine fault (--fault-error-rate)", 500)
        except APIError as e:
            return e.response()
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return await self._generate(request, api, model, params, prompts, base)

    def _make_requests(self, api: str, params: Params, prompts: list[list[int]], base: str) -> _Group:
        group = _Group()
        now = time.monotonic()
        for p_idx, ids in enumerate(prompts):
            if not ids:
                raise APIError("The prompt cannot be empty.")
            max_tokens = params.max_tokens
            if max_tokens is None:
                max_tokens = self.max_model_len - len(ids)
            if len(ids) + max_tokens > self.max_model_len:
                raise APIError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in the completion). "
                    "Please reduce the length of the messages or completion."
                )
            callback_id = f"chatcmpl-{base}" if api == "chat.completions" else f"cmpl-{base}-{p_idx}"
            for j in range(params.n):
                key = seed_key(ids, params.temperature, params.top_p, params.top_k, params.seed, j)
                sp = SamplingParams(max_tokens, params.min_tokens, params.ignore_eos, params.stop, key)
                rid = f"{callback_id}-{uuid.uuid4().hex[:8]}"
                if params.n > 1:
                    rid = f"{j}_{rid}"
                req = Request(rid, ids, sp, now, on_output=_on_output)
                seq = _Seq(req, p_idx * params.n + j)
                req.user = (seq, group)
                if self.connector is not None:
                    kv_params = params.kv_transfer_params
                    if params.batch_kv_transfer_params and callback_id in params.batch_kv_transfer_params:
                        kv_params = params.batch_kv_transfer_params[callback_id]
                    self.connector.prepare(req, kv_params, callback_id)
                group.seqs.append(seq)
        return group

    async def _generate(self, request, api, model, params, prompts, base) -> web.StreamResponse:
        try:
            group = self._make_requests(api, params, prompts, base)
        except APIError as e:
            return e.response()
        for seq in group.seqs:
            self.engine.add_request(seq.req)
        try:
            if params.stream:
                return await self._stream(request, api, model, params, group, base)
            return await self._full(api, model, params, group, base)
        finally:
            for seq in group.seqs:
                self.engine.abort(seq.req)
                if self.connector is not None:
                    self.connector.finished(seq.req)

    async def _wait(self, group: _Group) -> None:
        """Sleeps until the engine delivers output to any sequence of the group. The engine runs on this thread,
        so nothing can arrive between the caller's last look and this future's creation."""
        group.waiter = asyncio.get_running_loop().create_future()
        await group.waiter

    def _consume(self, seq: _Seq) -> tuple[list[int], str | None]:
        """Takes the sequence's pending tokens; applies stop strings. Returns (tokens, stop string hit)."""
        tokens, seq.pending = seq.pending, []
        stops = seq.req.params.stop
        if not stops:
            return tokens, None
        text = seq.held + self.text_of(tokens)
        # As vLLM, stop strings count only once min_tokens have been generated.
        active = len(seq.req.output_token_ids) > seq.req.params.min_tokens
        for stop in stops if active else ():
            pos = text.find(stop)
            if pos >= 0:
                seq.held = text[:pos]
                seq.finished = True
                self.engine.stop_request(seq.req, stop)
                return tokens, stop
        keep = max(len(s) for s in stops) - 1
        seq.held = text[len(text) - keep :] if keep and len(text) > keep else ("" if not keep else text)
        seq.text.append(text[: len(text) - len(seq.held)])
        return tokens, None

    # -- non-streaming ----------------------------------------------------------------------------------------

    async def _full(self, api, model, params: Params, group: _Group, base: str) -> web.Response:
        while True:
            for seq in group.seqs:
                tokens, _ = self._consume(seq)
                if not seq.req.params.stop:
                    seq.text.append(self.text_of(tokens))
            if all(s.finished for s in group.seqs):
                break
            await self._wait(group)
        for seq in group.seqs:
            if seq.req.status is Status.FINISHED_ERROR:
                raise_error = APIError(seq.req.stop_reason or "engine error", 500)
                return raise_error.response()
        kv_params = None
        for seq in group.seqs:
            req = seq.req
            if self.connector is not None and req.kv_transfer_params:
                params_in = req.kv_transfer_params
                if params_in.get("do_remote_decode") and params_in.get("remote_host") is not None:
                    try:
                        await self.connector.push(req, params_in)
                    except (OSError, ValueError, TimeoutError) as e:
                        return APIError(f"KV push to the decode engine failed: {e}", 500).response()
                kv_params = self.connector.finished_params(req) or kv_params
        created = int(time.time())
        prompt_tokens = sum(len(s.req.prompt_token_ids) for s in group.seqs[:: params.n])
        completion_tokens = sum(len(s.req.output_token_ids) for s in group.seqs)
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
        }
        choices = []
        for seq in group.seqs:
            text = "".join(seq.text) + seq.held
            req = seq.req
            if api == "chat.completions":
                message = {"role": "assistant", "content": text, "refusal": None, "annotations": None, "audio": None,
                           "function_call": None, "tool_calls": [], "reasoning_content": None}  # fmt: skip
                choices.append({"index": seq.index, "message": message, "logprobs": None,
                                "finish_reason": req.finish_reason, "stop_reason": req.stop_reason})  # fmt: skip
            else:
                choices.append({"index": seq.index, "text": text, "logprobs": None, "finish_reason": req.finish_reason,
                                "stop_reason": req.stop_reason, "prompt_logprobs": None})  # fmt: skip
        if api == "chat.completions":
            body = {"id": f"chatcmpl-{base}", "object": "chat.completion", "created": created, "model": model,
                    "choices": choices, "service_tier": None, "system_fingerprint": None, "usage": usage,
                    "prompt_logprobs": None, "kv_transfer_params": kv_params}  # fmt: skip
        else:
            body = {"id": f"cmpl-{base}", "object": "text_completion", "created": created, "model": model,
                    "choices": choices, "service_tier": None, "system_fingerprint": None, "usage": usage,
                    "kv_transfer_params": kv_params}  # fmt: skip
        return json_response(body, headers={"X-Request-Id": base})

    # -- streaming --------------------------------------------------------------------------------------------

    async def _stream(
        self, request, api, model, params: Params, group: _Group, base: str
    ) -> web.StreamResponse:
        chat = api == "chat.completions"
        created = int(time.time())
        rid = f"chatcmpl-{base}" if chat else f"cmpl-{base}"
        head = (
            b'data: {"id":' + encode(rid) + b',"object":"' + (b"chat.completion.chunk" if chat else b"text_completion")
            + b'","created":' + str(created).encode() + b',"model":' + encode(model) + b',"choices":[{"index":'
        )  # fmt: skip
        if chat:
            mid, tail = b',"delta":{"content":', b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            mid, tail = b',"text":', b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
        # Wait for the first output before answering, so errors before it are proper JSON errors.
        while not any(s.pending or s.finished for s in group.seqs):
            await self._wait(group)
        for seq in group.seqs:
            if seq.req.status is Status.FINISHED_ERROR:
                return APIError(seq.req.stop_reason or "engine error", 500).response()
        resp = web.StreamResponse(headers={**_SSE_HEADERS, "X-Request-Id": base})
        await resp.prepare(request)
        jtext = self._jtext
        index_bytes = [str(s.index).encode() for s in group.seqs]
        done: set[int] = set()
        while True:
            parts: list[bytes] = []
            for k, seq in enumerate(group.seqs):
                if k in done:
                    continue
                idx = index_bytes[k]
                if chat and not seq.sent_role:
                    seq.sent_role = True
                    parts.append(head + idx + b',"delta":{"role":"assistant","content":""},"logprobs":null,'
                                 b'"finish_reason":null}]}\n\n')  # fmt: skip
                tokens, _ = self._consume(seq)
                last = ""
                if seq.req.params.stop:
                    text = "".join(seq.text)
                    seq.text.clear()
                    if seq.finished:
                        last, seq.held = text + seq.held, ""
                    elif text:
                        parts.append(head + idx + mid + encode(text) + tail)
                else:
                    body = tokens
                    if seq.finished and tokens:
                        body, last = tokens[:-1], self.text_of(tokens[-1:])
                    for t in body:
                        parts.append(head + idx + mid + (jtext.get(t) or self._piece(t)) + tail)
                if seq.finished:
                    done.add(k)
                    req = seq.req
                    if req.status is Status.FINISHED_ERROR:
                        err = {"error": {"message": req.stop_reason, "type": "InternalServerError", "param": None,
                                         "code": 500}}  # fmt: skip
                        parts.append(b"data: " + encode(err) + b"\n\n")
                        continue
                    fin = encode(req.finish_reason or "stop")
                    stop_reason = encode(req.stop_reason)
                    if chat:
                        parts.append(head + idx + b',"delta":{"content":' + encode(last) + b'},"logprobs":null,'
                                     b'"finish_reason":' + fin + b',"stop_reason":' + stop_reason + b"}]}\n\n")  # fmt: skip
                    else:
                        parts.append(head + idx + b',"text":' + encode(last) + b',"logprobs":null,"finish_reason":'
                                     + fin + b',"stop_reason":' + stop_reason + b"}]}\n\n")  # fmt: skip
            finished = len(done) == len(group.seqs)
            if finished and params.include_usage:
                prompt_tokens = sum(len(s.req.prompt_token_ids) for s in group.seqs[:: params.n])
                completion_tokens = sum(len(s.req.output_token_ids) for s in group.seqs)
                usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                         "completion_tokens": completion_tokens}  # fmt: skip
                parts.append(
                    b'data: {"id":' + encode(rid) + b',"object":"'
                    + (b"chat.completion.chunk" if chat else b"text_completion") + b'","created":'
                    + str(created).encode() + b',"model":' + encode(model) + b',"choices":[],"usage":'
                    + encode(usage) + b"}\n\n"
                )  # fmt: skip
            if finished:
                parts.append(_DONE)
            if parts:
                try:
                    await resp.write(b"".join(parts))
                except (ConnectionResetError, RuntimeError):
                    return resp  # client went away; the finally block aborts the sequences
            if finished:
                break
            await self._wait(group)
        await resp.write_eof()
        return resp
