"""OpenAI wire details shared by the handlers: errors in vLLM's shape, request validation, JSON encoding.

Validation follows vLLM 0.32 (pydantic request models in lax mode, then its own checks):
- numbers and booleans sent as strings are converted as pydantic does ("3" -> 3, "yes" -> true, 2.0 -> 2); what
  cannot be converted is a pydantic error: `{"error": {"message": "1 validation error:\\n  {...}", "type":
  "Bad Request", "param": "body.<field>", "code": 400}}`;
- vLLM's own checks answer type "BadRequestError", mostly with `param` set and "(parameter=..., value=...)"
  appended to the message (a few, such as `n` and `min_tokens`, without).
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

_encode = msgspec.json.Encoder().encode

_ERROR_TYPES = {
    400: "BadRequestError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
#: vLLM's cap on `logprobs` / `top_logprobs` (`--max-logprobs`, default 20).
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with its HTTP status."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, kind: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.kind = kind

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind or _ERROR_TYPES.get(self.status, "InternalServerError"),
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self, headers: dict | None = None) -> web.Response:
        return json_response(self.body(), self.status, headers)


def invalid(message: str, param: str | None = None, value: Any = msgspec.UNSET) -> APIError:
    """One of vLLM's own 400s: the message ends with "(parameter=..., value=...)" when a parameter is named."""
    if param is not None:
        suffix = f"parameter={param}" if value is msgspec.UNSET else f"parameter={param}, value={value}"
        message = f"{message} ({suffix})"
    return APIError(message, 400, param)


def pydantic_error(kind: str, field: str, msg: str, value: Any) -> APIError:
    """A request-model validation error as vLLM's FastAPI layer renders pydantic's."""
    loc = f"body.{field}" if field else "body"
    shown = value if isinstance(value, str) else _describe(value)
    detail = {"type": kind, "loc": loc, "msg": msg, "input": shown}
    return APIError(f"1 validation error:\n  {detail!r}", 400, loc, "Bad Request")


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return repr(value)


def json_response(obj: Any, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json", headers=headers)


def encode(obj: Any) -> bytes:
    return _encode(obj)


# -- pydantic's lax conversions ---------------------------------------------------------------------------------

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def lax_int(body: dict, name: str) -> int | None:
    """An integer field: ints, integral floats and numeric strings are accepted (pydantic lax mode)."""
    value = body.get(name)
    if value is None or (type(value) is int):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise pydantic_error("int_from_float", name, "Input should be a valid integer, got a number with a fractional part", value)  # fmt: skip
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            try:
                as_float = float(value)
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
            raise pydantic_error("int_parsing", name, "Input should be a valid integer, unable to parse string as an integer", value) from None  # fmt: skip
    raise pydantic_error("int_type", name, "Input should be a valid integer", value)


def lax_float(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise pydantic_error("float_parsing", name, "Input should be a valid number, unable to parse string as a number", value) from None  # fmt: skip
    raise pydantic_error("float_type", name, "Input should be a valid number", value)


def lax_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise pydantic_error("bool_parsing", name, "Input should be a valid boolean, unable to interpret input", value)  # fmt: skip
    raise pydantic_error("bool_type", name, "Input should be a valid boolean", value)


class Params(msgspec.Struct):
    """The sampling-related fields of a completions or chat request, validated."""

    max_tokens: int | None
    min_tokens: int
    n: int
    stream: bool
    include_usage: bool
    #: `stream_options.continuous_usage_stats`: every chunk carries the usage so far.
    continuous_usage: bool
    ignore_eos: bool
    stop: tuple[str, ...]
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    #: Completions `logprobs` (top-k count) or chat `top_logprobs` when chat `logprobs` is true; None: off.
    logprobs: int | None
    #: Completions `echo`: the prompt precedes the answer (with its logprobs when `logprobs` is set).
    echo: bool
    #: vLLM's `cache_salt`: isolates the request's prefix cache blocks.
    cache_salt: str | None
    kv_transfer_params: dict | None
    #: Multi-prompt trigger legs: {callback request id: kv_transfer_params} (vLLM-Ascend's proxy sends it).
    batch_kv_transfer_params: dict | None
    #: vLLM's `priority`: with `--scheduling-policy priority` a smaller value is scheduled first (default 0).
    priority: int = 0


def parse_params(body: dict, chat: bool) -> Params:
    """vLLM's validation of the common fields; raises APIError (400)."""
    max_tokens = lax_int(body, "max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = lax_int(body, "max_completion_tokens")
    min_tokens = lax_int(body, "min_tokens") or 0
    n = lax_int(body, "n")
    n = 1 if n is None else n
    stream = lax_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise pydantic_error("model_type", "stream_options", "Input should be a valid dictionary or instance of StreamOptions", options)  # fmt: skip
    include_usage = bool(options and lax_bool(options, "include_usage", True))
    continuous = bool(options and lax_bool(options, "continuous_usage_stats"))
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise pydantic_error("string_type", "stop", "Input should be a valid string", str(stop))
    temperature = lax_float(body, "temperature")
    top_p = lax_float(body, "top_p")
    top_k = lax_int(body, "top_k")
    seed = lax_int(body, "seed")
    ignore_eos = lax_bool(body, "ignore_eos")
    if chat:
        want = lax_bool(body, "logprobs")
        top = lax_int(body, "top_logprobs")
        if top is not None and not want:
            raise invalid("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        logprobs = (top or 0) if want else None
        echo = False
    else:
        logprobs = lax_int(body, "logprobs")
        echo = lax_bool(body, "echo")
    ktp = body.get("kv_transfer_params")
    if ktp is not None and not isinstance(ktp, dict):
        raise pydantic_error("dict_type", "kv_transfer_params", "Input should be a valid dictionary", ktp)
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise pydantic_error("string_type", "cache_salt", "Input should be a valid string", salt)
    # vLLM's own checks, in its order.
    if options is not None and not stream:
        raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")
    if n < 1:
        raise APIError(f"n must be at least 1, got {n}.")
    if temperature is not None and temperature < 0:
        raise invalid(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if min_tokens < 0:
        raise APIError(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        name = "top_logprobs" if chat else "logprobs"
        raise invalid(f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
                      f"{MAX_LOGPROBS}", name, logprobs)  # fmt: skip
    batch = body.get("batch_kv_transfer_params")
    return Params(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        ignore_eos=ignore_eos,
        stop=stops,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        logprobs=logprobs,
        echo=echo,
        cache_salt=salt,
        kv_transfer_params=ktp,
        batch_kv_transfer_params=batch if isinstance(batch, dict) else None,
        priority=lax_int(body, "priority") or 0,
    )
