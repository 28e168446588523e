"""HTTP server of the simulated engine (aiohttp): vLLM's OpenAI routes plus health, metrics, tokenize, render."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from dataclasses import asdict
from typing import Any

import msgspec
from aiohttp import web

from simengine.config import EngineConfig
from simengine.connectors.factory import create_connector
from simengine.engine import Engine
from simengine.kv_publisher import ZmqEventPublisher
from simengine.lora import LoraError
from simengine.metrics import EngineMetrics
from simengine.openai_serving import VLLM_VERSION, OpenAIServing
from simengine.protocol import APIError, json_response, pydantic_error
from simengine.sampler import Sampler
from tandem import tracing
from tandem.tokenizer import load_tokenizer, prompt_token_ids

log = logging.getLogger("simengine")
#: The routes spanned when tracing is on (vLLM's `llm_request` span).
_TRACED_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
#: The vLLM version simengine answers as (its wire behaviour is checked against it by tests/vllm).
VERSION = VLLM_VERSION
#: vLLM's switch for the runtime adapter routes (vllm/envs.py): "1" or "true", any case, spaces trimmed.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_SCALE_OUT_DISABLED = (
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
)


class EngineServer:
    """Wires tokenizer, engine, publisher, connector and routes; `run()` serves until SIGTERM/SIGINT."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.metrics = EngineMetrics(cfg.served_model_names[0], str(cfg.dp_rank), cfg.max_model_len)
        self.metrics.set_cache_config(cfg)
        self.publisher = None
        if cfg.kv_events.enabled:
            self.publisher = ZmqEventPublisher(
                cfg.kv_events, cfg.dp_rank, cfg.kv_events_legacy_format, cfg.fault_event_gap_every
            )
        sampler = Sampler(self.tokenizer.word_ids, self.tokenizer.eos_token_id)
        self.engine = Engine(cfg, sampler, self.metrics, self.publisher)
        self.connector = create_connector(cfg, self.engine)
        self.serving = OpenAIServing(
            self.engine,
            self.tokenizer,
            cfg.served_model_names,
            cfg.max_model_len,
            self.connector,
            cfg.enable_request_id_headers,
            cfg.enable_prompt_tokens_details,
        )
        self.created = int(time.time())
        self.runtime_lora = runtime_lora_allowed(os.environ)
        self._load_static_loras()
        if cfg.otlp_traces_endpoint:  # as vLLM: the flag turns tracing on, the OTEL_* environment tunes it
            traced = tracing.from_env({**os.environ, tracing.OTLP_TRACES_ENDPOINT: cfg.otlp_traces_endpoint})
            tracing.setup(traced, os.environ.get("OTEL_SERVICE_NAME", "simengine"))
        self.app = self._build_app()

    @web.middleware
    async def _wire(self, request: web.Request, handler) -> web.StreamResponse:
        """vLLM's framing of every answer: 404/405 as `{"detail": ...}` JSON (FastAPI's), and with
        `--enable-request-id-headers` an X-Request-Id on every response, the client's or a new one."""
        rid = None
        if self.cfg.enable_request_id_headers:
            rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
            request["request_id"] = rid
        try:
            if tracing.ENABLED and request.path in _TRACED_PATHS:
                parent = tracing.context_of(
                    {tracing.TRACEPARENT: request.headers.get(tracing.TRACEPARENT, "")}
                )
                attributes = {"gen_ai.request.id": request.headers.get("X-Request-Id", "")}
                with tracing.span("llm_request", parent, attributes, root=True) as current:
                    response = await handler(request)
                    tracing.set_attributes(current, {"http.response.status_code": response.status})
            else:
                response = await handler(request)
        except web.HTTPException as e:
            if e.status not in (404, 405):
                raise
            detail = "Not Found" if e.status == 404 else "Method Not Allowed"
            headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            response = json_response({"detail": detail}, e.status, headers)
        if rid is not None and not response.prepared:
            response.headers["X-Request-Id"] = rid
        return response

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._wire])
        r = app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions/render", self.render_completions)
        r.add_post("/v1/chat/completions/render", self.render_chat)
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_post("/ping", self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/version", self.version)
        r.add_get("/load", self.load)
        r.add_get("/kv_event_sources", self.kv_event_sources)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_get("/metrics", self.metrics_endpoint)
        if self.runtime_lora:  # as vLLM: without the variable the routes do not exist (404)
            r.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
            r.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        return app

    def _load_static_loras(self) -> None:
        """`--lora-modules`, loaded before serving; one that cannot be loaded stops the start (as vLLM)."""
        lora = self.engine.lora
        for name, path, base in self.cfg.lora_modules:
            assert lora is not None  # the config requires --enable-lora with --lora-modules
            try:
                lora.check_load(name, path)
                rank = lora.read(name, path)
            except LoraError as e:
                raise ValueError(e.message) from None
            lora.add(name, path, rank, base if base in self.cfg.served_model_names else None)

    # -- handlers ---------------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serving.handle(request, "completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.serving.handle(request, "chat.completions")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.is_alive else 503)  # empty, no content type: as vLLM

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """vLLM 0.32: the KV events config per DP rank (this process is one rank), endpoints as offset."""
        if not self.cfg.kv_events.enabled:
            return json_response({})
        source = asdict(self.cfg.kv_events)
        source.pop("self_describing_kv_events", None)
        if self.publisher is not None:
            source["endpoint"] = self.publisher.endpoint
            source["replay_endpoint"] = self.publisher.replay_endpoint
        return json_response({str(self.cfg.dp_rank): source})

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": VERSION})

    async def load(self, request: web.Request) -> web.Response:
        s = self.engine.scheduler
        return json_response({"server_load": len(s.running) + len(s.waiting) + len(s.remote_waiting)})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's `/v1/load_lora_adapter`: `{"lora_name", "lora_path", "load_inplace"?}`; 200 with a plain-text
        success line, or an error JSON (`simengine.lora` lists them). A successful load takes `--lora-load-ms`."""
        try:
            body = await self._lora_body(request, ("lora_name", "lora_path"))
            lora = self.engine.lora
            name, path = body["lora_name"], body["lora_path"]
            if lora is None:
                raise APIError("LoRA is not enabled. Use --enable-lora to enable LoRA.", 500)
            lora.check_load(name, path, bool(body.get("load_inplace")))
            rank = lora.read(name, path)
        except APIError as e:
            return e.response()
        except LoraError as e:
            return APIError(e.message, e.status, None, e.kind).response()
        if self.cfg.lora_load_ms:
            await asyncio.sleep(self.cfg.lora_load_ms / 1000 / self.cfg.speedup)
        lora.add(name, path, rank)
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return web.Response(body=f"Success: LoRA adapter '{name}' added successfully.".encode())

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's `/v1/unload_lora_adapter`: `{"lora_name"}`; the name is forgotten, requests naming it get 404."""
        try:
            body = await self._lora_body(request, ("lora_name",))
            if self.engine.lora is None:
                raise LoraError(
                    f"The lora adapter '{body['lora_name']}' cannot be found.", "NotFoundError", 404
                )
            self.engine.lora.remove(body["lora_name"])
        except APIError as e:
            return e.response()
        except LoraError as e:
            return APIError(e.message, e.status, None, e.kind).response()
        log.info("Removed LoRA adapter: name '%s'", body["lora_name"])
        return web.Response(
            body=f"Success: LoRA adapter '{body['lora_name']}' removed successfully.".encode()
        )

    async def _lora_body(self, request: web.Request, required: tuple[str, ...]) -> dict:
        """The JSON body with its required string fields, refused as vLLM's request models refuse it."""
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as e:
            raise pydantic_error("json_invalid", "", f"JSON decode error: {e}", {}) from None
        if not isinstance(body, dict):
            raise pydantic_error(
                "model_attributes_type", "", "Input should be a valid dictionary or object to extract fields from",
                body,
            )  # fmt: skip
        for key in required:
            if key not in body:
                raise pydantic_error("missing", key, "Field required", body)
            if not isinstance(body[key], str):
                raise pydantic_error("string_type", key, "Input should be a valid string", body[key])
        return body

    async def models(self, request: web.Request) -> web.Response:
        data: list[dict[str, Any]] = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": self.cfg.model,
                "parent": None,
                "max_model_len": self.cfg.max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{name}",
                        "object": "model_permission",
                        "created": self.created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for name in self.cfg.served_model_names
        ]
        if self.engine.lora is not None:  # vLLM's adapter cards: root the path, parent the base model
            for adapter in self.engine.lora.adapters.values():
                card = dict(
                    data[0], id=adapter.name, root=adapter.path, parent=adapter.parent, max_model_len=None
                )
                card["permission"] = [dict(data[0]["permission"][0], id=f"modelperm-{adapter.name}")]
                data.append(card)
        return json_response({"object": "list", "data": data})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        self.engine._update_gauges()
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _body(self, request: web.Request) -> dict:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as e:
            raise APIError(f"JSON decode error: {e}") from None
        if not isinstance(body, dict):
            raise APIError("request body must be a JSON object")
        self.serving.check_model(body)
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            api = "chat.completions" if "messages" in body else "completions"
            if api == "completions" and not isinstance(body.get("prompt"), str):
                raise APIError("'prompt' must be a string")
            ids = prompt_token_ids(self.tokenizer, api, body)[0]
        except ValueError as e:
            return APIError(str(e)).response()
        except APIError as e:
            return e.response()
        strs = [self.tokenizer.id_to_piece(t) for t in ids] if body.get("return_token_strs") else None
        return json_response(
            {"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise APIError("'tokens' must be an array of integers")
            text = self.tokenizer.decode(tokens)
        except ValueError as e:
            return APIError(str(e)).response()
        except APIError as e:
            return e.response()
        return json_response({"prompt": text})

    def _generate_request(self, body: dict, ids: list[int], request_id: str) -> dict:
        """vLLM 0.32's scale-out `GenerateRequest` for one prompt (the token-in-token-out request a router sends
        to `/inference/v1/generate`). As vLLM dumps it: `sampling_params` omits fields at their defaults, except
        the lists and `skip_reading_prefix_cache`; `max_tokens` is what the engine would allow."""
        stream = bool(body.get("stream"))
        stop = body.get("stop")
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        fits = self.cfg.max_model_len - len(ids)
        sampling: dict = {
            "stop": [stop] if isinstance(stop, str) else list(stop or []),
            "stop_token_ids": [],
            "max_tokens": min(asked, fits) if isinstance(asked, int) else fits,
            "bad_words": [],
            "skip_reading_prefix_cache": False,
        }
        for name, default in (("n", 1), ("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("seed", None),
                              ("min_tokens", 0), ("ignore_eos", False)):  # fmt: skip
            value = body.get(name)
            if value is not None and value != default:
                sampling[name] = value
        return {"request_id": request_id, "token_ids": ids, "token_offsets": None, "features": None,
                "content_parts": None, "sampling_params": sampling, "model": body.get("model"),
                "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
                "output_mode": "tokens", "stream": stream,
                "stream_options": body.get("stream_options") if stream else None,
                "cache_salt": body.get("cache_salt"), "priority": body.get("priority") or 0,
                "kv_transfer_params": None, "ec_transfer_params": None}  # fmt: skip

    async def render_completions(self, request: web.Request) -> web.Response:
        if not self.cfg.enable_scale_out:
            return APIError(_SCALE_OUT_DISABLED, 403).response()
        try:
            body = await self._body(request)
            prompts = self.serving.prompts_of("completions", body)
        except APIError as e:
            return e.response()
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return json_response(
            [self._generate_request(body, ids, f"{base}-{i}") for i, ids in enumerate(prompts)]
        )

    async def render_chat(self, request: web.Request) -> web.Response:
        if not self.cfg.enable_scale_out:
            return APIError(_SCALE_OUT_DISABLED, 403).response()
        try:
            body = await self._body(request)
            ids = self.serving.prompts_of("chat.completions", body)[0]
        except APIError as e:
            return e.response()
        return json_response(
            self._generate_request(body, ids, request.headers.get("X-Request-Id") or uuid.uuid4().hex)
        )

    # -- lifecycle --------------------------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # As vLLM, a request whose client went away is aborted (its handler is cancelled, which aborts the
        # sequences and frees their blocks), streamed or not.
        runner = web.AppRunner(
            self.app, access_log=None, handle_signals=False, shutdown_timeout=1.0, handler_cancellation=True
        )
        await runner.setup()
        site = web.TCPSite(runner, self.cfg.host, self.cfg.port, reuse_address=True, backlog=1024)
        await site.start()
        self.engine.start()
        if self.connector is not None:
            await self.connector.start()
        extra = ""
        if self.connector is not None:
            extra += f" kv_connector={self.cfg.kv_transfer.kv_connector} kv_port={self.connector.port}"
        if self.publisher is not None:
            extra += f" kv_events={self.publisher.endpoint}"
        log.info(
            "simengine ready on http://%s:%d model=%s profile=%s speedup=%g%s",
            self.cfg.host, self.cfg.port, self.cfg.served_model_names[0], self.cfg.profile, self.cfg.speedup, extra,
        )  # fmt: skip
        await stop.wait()
        log.info("simengine stopping")
        await site.stop()
        if self.connector is not None:
            await self.connector.stop()
        await self.engine.stop()
        await runner.cleanup()


def runtime_lora_allowed(environ) -> bool:
    """vLLM's reading of VLLM_ALLOW_RUNTIME_LORA_UPDATING: "1" or "true" (any case, spaces trimmed)."""
    return environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
