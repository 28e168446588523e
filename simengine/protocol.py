"""OpenAI wire details shared by the handlers: errors in vLLM's shape, request validation, JSON encoding."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

_encode = msgspec.json.Encoder().encode

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with its HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "InternalServerError"),
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> web.Response:
        return json_response(self.body(), self.status)


def json_response(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json", headers=headers)


def encode(obj: Any) -> bytes:
    return _encode(obj)


def _int(body: dict, name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise APIError(f"'{name}' must be an integer", param=name)
    if value < minimum:
        raise APIError(f"{name} must be at least {minimum}, got {value}.", param=name)
    return value


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise APIError(f"'{name}' must be a number", param=name)
    return float(value)


class Params(msgspec.Struct):
    """The sampling-related fields of a completions or chat request, validated."""

    max_tokens: int | None
    min_tokens: int
    n: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    stop: tuple[str, ...]
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    kv_transfer_params: dict | None
    #: Multi-prompt trigger legs: {callback request id: kv_transfer_params} (vLLM-Ascend's proxy sends it).
    batch_kv_transfer_params: dict | None


def parse_params(body: dict, chat: bool) -> Params:
    """vLLM's validation of the common fields; raises APIError (400)."""
    max_tokens = _int(body, "max_tokens", None, 1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", None, 1)
    min_tokens = _int(body, "min_tokens", 0, 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
                       param="min_tokens")  # fmt: skip
    n = _int(body, "n", 1, 1) or 1
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise APIError("Stream options can only be defined when `stream=True`.", param="stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError("'stream_options' must be an object", param="stream_options")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise APIError("'stop' must be a string or an array of strings", param="stop")
    temperature = _number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise APIError(f"temperature must be non-negative, got {temperature}.", param="temperature")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise APIError(f"top_p must be in (0, 1], got {top_p}.", param="top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool)):
        raise APIError("'top_k' must be an integer", param="top_k")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise APIError("'seed' must be an integer", param="seed")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError("'ignore_eos' must be a boolean", param="ignore_eos")
    ktp = body.get("kv_transfer_params")
    if ktp is not None and not isinstance(ktp, dict):
        raise APIError("'kv_transfer_params' must be an object", param="kv_transfer_params")
    return Params(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        n=n,
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        ignore_eos=ignore_eos,
        stop=stops,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        kv_transfer_params=ktp,
        batch_kv_transfer_params=batch
        if isinstance(batch := body.get("batch_kv_transfer_params"), dict)
        else None,
    )
