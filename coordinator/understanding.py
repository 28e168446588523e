"""Understanding an OpenAI request body, before anything is scheduled (pure): the one pipeline every decision
path runs, inline on the event loop or in a worker process (`coordinator/understand_pool.py`).

`understand_body`, in order: parse the JSON (`parse_body`); check it against the request limits
(`coordinator.limits`); find its model among those served; refuse a prompt far beyond the model's context before
tokenizing it; validate the fields scheduling relies on and tokenize the prompts as the engine will (`understand`);
check prompt plus output against the context. The result is an `OpenAIRequest`, with the figures the picker
schedules on. Every refusal is an `OpenAIError` (400, or 404 for a model not served).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.errors import OpenAIError
from coordinator.limits import check_body, check_context, check_prompt_size
from coordinator.tenants import requested_tier
from tandem.tokenizer import Tokenizer, prompt_token_ids

#: Paths the coordinator routes, and the API name `tandem.tokenizer.prompt_token_ids` knows them by.
ROUTED_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions"}


@dataclass(slots=True)
class OpenAIRequest:
    """A validated OpenAI request."""

    api: str  # "completions" | "chat.completions"
    model: str
    stream: bool
    body: dict[str, Any]
    prompts: list[list[int]]  # prompt token ids, one list per prompt
    max_tokens: int  # output tokens counted for workload, over all prompts and choices
    n: int = 1  # choices per prompt
    service_tier: str | None = None  # OpenAI's `service_tier` as asked (None: absent or `auto`)
    #: The LoRA adapter the request names (its `model` field, which the engine gets unchanged: vLLM serves an
    #: adapter by its name); `model` is then the adapter's base model. "" for the base model itself.
    adapter: str = ""

    @property
    def prompt_tokens(self) -> int:
        """Input sequence length over all prompts."""
        return sum(len(p) for p in self.prompts)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body; OpenAIError 400 for anything else."""
    if not raw:
        raise OpenAIError(400, "The request body is empty; expected a JSON object.")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OpenAIError(400, f"The request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise OpenAIError(400, "The request body nests JSON too deeply.") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"The request body must be a JSON object, not {type(body).__name__}.")
    return body


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OpenAIError(400, f"`{key}` must be a positive integer, got {json.dumps(value)}.", key)
    return value


def model_of(body: dict[str, Any]) -> str:
    """The `model` field; OpenAIError 400 when missing or not a string."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "`model` is required and must be a non-empty string.", "model")
    return model


def understand(
    api: str, body: dict[str, Any], tokenizer: Tokenizer, default_max_tokens: int
) -> OpenAIRequest:
    """Validates the fields scheduling relies on and tokenizes the prompt as the engine will."""
    model = model_of(body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise OpenAIError(400, f"`stream` must be a boolean, got {json.dumps(stream)}.", "stream")
    if api == "chat.completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise OpenAIError(400, "`messages` is required and must be a non-empty array.", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise OpenAIError(400, f"`messages[{i}]` must be an object with a string `role`.", "messages")
    elif "prompt" not in body:
        raise OpenAIError(400, "`prompt` is required.", "prompt")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    n = _positive_int(body, "n") or 1
    tier = requested_tier(body)
    try:
        prompts = prompt_token_ids(tokenizer, api, body)
    except ValueError as exc:
        param = "messages" if api == "chat.completions" else "prompt"
        raise OpenAIError(400, str(exc), param) from None
    per_choice = max_tokens if max_tokens is not None else default_max_tokens
    return OpenAIRequest(api, model, stream, body, prompts, per_choice * n * len(prompts), n, tier)


def resolve_model(named: str, known_models: Collection[str], adapters: Mapping[str, str]) -> tuple[str, str]:
    """(base model, adapter) of a request's `model` field: a served model itself (adapter ""), or a configured
    adapter of one. OpenAIError 404 for any other name, in the shape vLLM (and simengine) answer an unknown model
    or adapter with: type `NotFoundError`, param `model`, code 404."""
    if named in known_models:
        return named, ""
    base = adapters.get(named)
    if base is not None and base in known_models:
        return base, named
    served = ", ".join(sorted(known_models)) or "none"
    names = sorted(a for a, b in adapters.items() if b in known_models)
    also = f"; adapters: {', '.join(names)}" if names else ""
    raise OpenAIError(404, f"The model `{named}` does not exist. Models served: {served}{also}.", "model")


class TokenizerCache:
    """One tokenizer per model, loaded on first use."""

    def __init__(self, paths: dict[str, str | None], load: Callable[[str | None], Tokenizer]) -> None:
        self._paths = paths
        self._load = load
        self._by_model: dict[str, Tokenizer] = {}

    def get(self, model: str) -> Tokenizer:
        """The tokenizer of `model` (the built-in one when the config names none)."""
        tok = self._by_model.get(model)
        if tok is None:
            tok = self._by_model[model] = self._load(self._paths.get(model))
        return tok


def understand_body(
    api: str,
    raw_body: bytes,
    known_models: Collection[str],
    tokenizers: TokenizerCache,
    config: CoordinatorConfig,
    max_model_len: Mapping[str, int] | None = None,
    adapters: Mapping[str, str] | None = None,
) -> OpenAIRequest:
    """Parses, checks against the request limits, and tokenizes a body (pure: also run in decision worker
    processes, so that a large body gets the same checks there); OpenAIError 400 for bad input or a request over
    the limits, 404 for a model not in `known_models` nor an adapter of one. `max_model_len`: the context length of
    the models that declare one. `adapters`: the configured LoRA adapters, name -> base model (the mesh file's
    `models[].adapters`): a request naming one is understood as its base model's (tokenizer, context) with
    `adapter` set."""
    body = parse_body(raw_body)
    check_body(api, body, config.limits)
    named = model_of(body)
    model, adapter = resolve_model(named, known_models, adapters or {})
    chat = api == "chat.completions"
    default_max = config.chat_default_max_tokens if chat else config.default_max_tokens
    context = (max_model_len or {}).get(model)
    # Before tokenizing: a prompt far beyond the context would hold the tokenizer for seconds.
    check_prompt_size(api, body, context, config.limits, model)
    request = understand(api, body, tokenizers.get(model), default_max)
    request.model, request.adapter = model, adapter
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    check_context(request.prompts, asked, context, model)
    return request
