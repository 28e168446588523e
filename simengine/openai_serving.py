"""`/v1/completions` and `/v1/chat/completions` as vLLM's OpenAI server answers them, streamed or not: validation,
the engine requests of one answer, stop strings, echo, waiting for output; each API's answer shapes are its
encoder's (simengine/encoders/).

The per-token path is kept cheap: the engine loop appends token ids to each sequence and resolves one future per
HTTP request per step; the handler then turns every pending token into an SSE event with the API's chunk encoder
(prebuilt byte templates) and writes them all with one `write`.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import msgspec
from aiohttp import web

from simengine.connectors.interface import KVConnector
from simengine.encoders.interface import Answer, ApiEncoder, Choice, EncoderTools
from simengine.encoders.registry import create_encoders
from simengine.engine import Engine
from simengine.logprobs import LogprobsBuilder
from simengine.lora import LoraAdapter
from simengine.protocol import APIError, Params, encode, invalid, json_response, parse_params, pydantic_error
from simengine.request import Request, SamplingParams, Status
from simengine.sampler import seed_key
from tandem.tokenizer import prompt_token_ids

_decode_json = msgspec.json.Decoder().decode
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"
VLLM_VERSION = "0.32.0"


class _Group:
    """All sequences of one HTTP request and the future the engine resolves when any has output."""

    __slots__ = ("seqs", "waiter")

    def __init__(self) -> None:
        self.seqs: list[Choice] = []
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

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        model_names: list[str],
        max_model_len: int,
        connector: KVConnector | None = None,
        request_id_headers: bool = False,
        prompt_tokens_details: bool = False,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_names = model_names
        self.max_model_len = max_model_len
        self.connector = connector
        #: vLLM's `--enable-request-id-headers`: SSE responses carry X-Request-Id too (set before streaming).
        self.request_id_headers = request_id_headers
        #: vLLM's `--enable-prompt-tokens-details`: usage reports the prompt tokens found in the prefix cache.
        self.prompt_tokens_details = prompt_tokens_details
        self.eos = tokenizer.eos_token_id
        self._text: dict[int, str] = {}
        self._jtext: dict[int, bytes] = {}
        for tid in tokenizer.word_ids:
            self._piece(tid)
        self.num_requests = 0
        cfg = engine.cfg
        self.fault_rng = random.Random(cfg.fault_seed)
        # vLLM's fingerprint is its version plus a per-deployment hash; one per process here.
        fingerprint = f"vllm-{VLLM_VERSION}-{uuid.uuid4().hex[:8]}"
        logprobs = LogprobsBuilder(self.text_of, tokenizer.word_ids)
        #: The answer shapes of each API, by the API name the routes give.
        self.encoders = create_encoders(EncoderTools(logprobs, tokenizer.decode, fingerprint))

    def _piece(self, tid: int) -> bytes:
        j = self._jtext.get(tid)
        if j is None:
            text = "" if tid == self.eos else self.tokenizer.decode([tid])
            self._text[tid] = text
            j = self._jtext[tid] = encode(text)
        return j

    def text_of(self, tokens: list[int]) -> str:
        text = self._text
        return "".join([text[t] if t in text else self._text_of_new(t) for t in tokens])

    def _text_of_new(self, tid: int) -> str:
        self._piece(tid)  # decodes once and caches the text and its JSON form
        return self._text[tid]

    # -- entry ------------------------------------------------------------------------------------------------

    def check_model(self, body: dict) -> str:
        model = body.get("model")
        if model is None:
            return self.model_names[0]
        lora = self.engine.lora
        if model not in self.model_names and (lora is None or lora.get(model) is None):
            raise APIError(
                f"The model `{model}` does not exist. Valid aliases: {', '.join(self.model_names)}.",
                404,
                "model",
            )
        return model

    def prompts_of(self, api: str, body: dict) -> list[list[int]]:
        """Prompt token ids per prompt, with vLLM's errors for missing, empty and invalid prompts."""
        if api == "completions":
            prompt = body.get("prompt")
            if prompt is None or prompt == "":
                raise invalid("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
            if prompt == []:
                raise APIError("You must pass at least one prompt")
        elif "messages" not in body:
            raise pydantic_error("missing", "messages", "Field required", body)
        try:
            prompts = prompt_token_ids(self.tokenizer, api, body)
        except ValueError as e:
            raise APIError(str(e)) from None
        if any(not ids for ids in prompts):
            raise invalid("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        return prompts

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
                raise pydantic_error("json_invalid", _error_pos(str(e)), "JSON decode error", {}) from None
            if not isinstance(body, dict):
                raise pydantic_error(
                    "model_attributes_type", "", "Input should be a valid dictionary or object to extract fields from",
                    body,
                )  # fmt: skip
            model = self.check_model(body)
            chat = api == "chat.completions"
            params = parse_params(body, chat)
            if (
                params.priority != 0 and cfg.scheduling_policy != "priority"
            ):  # vLLM's processor refuses it too
                raise APIError(f"Got priority {params.priority} but Priority scheduling is not enabled.")
            prompts = self.prompts_of(api, body)
            if cfg.fault_hang:
                await asyncio.Event().wait()
            if cfg.fault_latency_ms:
                await asyncio.sleep(cfg.fault_latency_ms / 1000.0)
            if cfg.fault_error_rate and self.fault_rng.random() < cfg.fault_error_rate:
                raise APIError("simulated engine fault (--fault-error-rate)", 500)
        except APIError as e:
            return e.response()
        header_id = request.headers.get("X-Request-Id")
        base = header_id or uuid.uuid4().hex[:16]
        adapter = self.engine.lora.get(model) if self.engine.lora is not None else None
        return await self._generate(request, self.encoders[api], model, params, prompts, base, adapter)

    def _max_tokens(self, params: Params, num_prompt: int) -> int:
        """vLLM's budget: `max_tokens` above the context is an error, otherwise it is cut to what fits."""
        limit = self.max_model_len
        asked = params.max_tokens
        if asked is not None and asked > limit:
            raise invalid(f"max_tokens={asked} cannot be greater than max_model_len={limit}. Please request fewer "
                          "output tokens.", "max_tokens", asked)  # fmt: skip
        if num_prompt > limit:
            raise invalid(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                          f"{num_prompt} input tokens, which exceeds this limit even without any output tokens. "
                          "Please reduce the length of the input prompt.", "input_tokens", num_prompt)  # fmt: skip
        fits = limit - num_prompt
        budget = fits if asked is None else min(asked, fits)
        if budget < 1:
            raise invalid(f"max_tokens must be at least 1, got {budget}.", "max_tokens", budget)
        return budget

    def _make_requests(
        self,
        encoder: ApiEncoder,
        params: Params,
        prompts: list[list[int]],
        base: str,
        adapter: LoraAdapter | None = None,
    ) -> _Group:
        group = _Group()
        now = time.monotonic()
        for p_idx, ids in enumerate(prompts):
            max_tokens = self._max_tokens(params, len(ids))
            callback_id = encoder.callback_id(base, p_idx)
            for j in range(params.n):
                key = seed_key(ids, params.temperature, params.top_p, params.top_k, params.seed, j)
                sp = SamplingParams(max_tokens, params.min_tokens, params.ignore_eos, params.stop, key)
                rid = f"{callback_id}-{uuid.uuid4().hex[:8]}"
                if params.n > 1:
                    rid = f"{j}_{rid}"
                req = Request(
                    rid,
                    ids,
                    sp,
                    now,
                    on_output=_on_output,
                    cache_salt=params.cache_salt,
                    priority=params.priority,
                    lora=adapter,
                )
                seq = Choice(req, p_idx * params.n + j)
                req.user = (seq, group)
                if self.connector is not None:
                    kv_params = params.kv_transfer_params
                    if params.batch_kv_transfer_params and callback_id in params.batch_kv_transfer_params:
                        kv_params = params.batch_kv_transfer_params[callback_id]
                    self.connector.prepare(req, kv_params, callback_id)
                group.seqs.append(seq)
        return group

    async def _generate(
        self, request, encoder: ApiEncoder, model, params, prompts, base, adapter: LoraAdapter | None = None
    ) -> web.StreamResponse:
        try:
            group = self._make_requests(encoder, params, prompts, base, adapter)
        except APIError as e:
            return e.response()
        for seq in group.seqs:
            self.engine.add_request(seq.req)
        answer = Answer(model, params, base, group.seqs)
        try:
            if params.stream:
                return await self._stream(request, encoder, answer, group)
            return await self._full(encoder, answer, group)
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

    def _consume(self, seq: Choice) -> tuple[list[int], str | None]:
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

    async def _full(self, encoder: ApiEncoder, answer: Answer, group: _Group) -> web.Response:
        params = answer.params
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
        if self.connector is not None:
            for seq in group.seqs:
                try:
                    kv_params = await self.connector.complete(seq.req) or kv_params
                except (OSError, ValueError, TimeoutError) as e:
                    return APIError(f"KV push to the decode engine failed: {e}", 500).response()
        prompt_tokens = sum(len(s.req.prompt_token_ids) for s in group.seqs[:: params.n])
        completion_tokens = sum(len(s.req.output_token_ids) for s in group.seqs)
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": self._cached_details(group.seqs[:: params.n]),
            "completion_tokens_details": None,
        }
        return json_response(encoder.body(answer, usage, kv_params))

    def _cached_details(self, seqs) -> dict[str, int] | None:
        """`usage.prompt_tokens_details` as vLLM answers it: `{"cached_tokens": N}` (the prompt tokens its prefix
        cache held when each prompt was first scheduled) with `--enable-prompt-tokens-details`, else null."""
        if not self.prompt_tokens_details:
            return None
        return {"cached_tokens": sum(max(s.req.num_cached_tokens, 0) for s in seqs)}

    # -- streaming --------------------------------------------------------------------------------------------

    async def _stream(
        self, request: web.Request, encoder: ApiEncoder, answer: Answer, group: _Group
    ) -> web.StreamResponse:
        """vLLM's SSE: the encoder's opening chunks, then per choice its text as it comes (one chunk per token, or
        per wake-up while stop strings may still match), its last chunk with the finish reason, an error chunk
        after a failed choice, the usage chunk when asked for, and `[DONE]`."""
        params = answer.params
        chunks = encoder.stream(answer)
        # Wait for the first output before answering, so errors before it are proper JSON errors.
        while not any(s.pending or s.finished for s in group.seqs):
            await self._wait(group)
        for seq in group.seqs:
            if seq.req.status is Status.FINISHED_ERROR:
                return APIError(seq.req.stop_reason or "engine error", 500).response()
        headers = dict(_SSE_HEADERS)
        if self.request_id_headers:
            headers["X-Request-Id"] = request.get("request_id") or answer.base
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        jtext = self._jtext
        token_chunk = chunks.token
        done: set[int] = set()
        parts = chunks.opening()
        while True:
            for n_, seq in enumerate(group.seqs):
                if n_ in done:
                    continue
                tokens, _ = self._consume(seq)
                prefix = ""
                prompt_ids = b"null"
                if params.echo and not seq.started:
                    seq.started = True  # completions: the echoed prompt leads the first chunk
                    prefix = self.tokenizer.decode(seq.req.prompt_token_ids)
                    prompt_ids = encode(seq.req.prompt_token_ids)
                if seq.req.params.stop:
                    text = prefix + "".join(seq.text)
                    seq.text.clear()
                    if seq.finished:
                        parts.append(token_chunk(n_, seq, encode(text + seq.held), tokens, True, prompt_ids))
                        seq.held = ""
                    elif text:
                        parts.append(token_chunk(n_, seq, encode(text), tokens, False, prompt_ids))
                else:
                    last = len(tokens) - 1
                    for i, t in enumerate(tokens):
                        piece = jtext.get(t) or self._piece(t)
                        if prefix:
                            piece, prefix = encode(prefix + self.text_of([t])), ""
                        final = seq.finished and i == last
                        parts.append(token_chunk(n_, seq, piece, [t], final, prompt_ids))
                        prompt_ids = b"null"
                    if seq.finished and not tokens:
                        parts.append(token_chunk(n_, seq, encode(prefix), [], True, prompt_ids))
                if seq.finished:
                    done.add(n_)
                    req = seq.req
                    if req.status is Status.FINISHED_ERROR:
                        err = {"error": {"message": req.stop_reason, "type": "InternalServerError", "param": None,
                                         "code": 500}}  # fmt: skip
                        parts.append(b"data: " + encode(err) + b"\n\n")
            finished = len(done) == len(group.seqs)
            if finished and params.include_usage:
                prompt_tokens = sum(len(s.req.prompt_token_ids) for s in group.seqs[:: params.n])
                completion_tokens = sum(len(s.req.output_token_ids) for s in group.seqs)
                details = self._cached_details(group.seqs[:: params.n])
                parts.append(chunks.usage(prompt_tokens, completion_tokens, details))
            if finished:
                parts.append(_DONE)
            if parts:
                try:
                    await resp.write(b"".join(parts))
                except (ConnectionResetError, RuntimeError):
                    return resp  # client went away; the finally block aborts the sequences
                parts = []
            if finished:
                break
            await self._wait(group)
        await resp.write_eof()
        return resp


def _error_pos(message: str) -> str:
    """The byte position msgspec names in a JSON decode error ("... (byte 28)"), as pydantic's `loc`."""
    tail = message.rsplit("byte ", 1)
    return tail[1].rstrip(")") if len(tail) == 2 else "0"
