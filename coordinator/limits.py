"""Limits on what one OpenAI request may ask for, checked before any work is spent on it (pure functions).

Envoy already bounds the body (`tandem.limits.MAX_BODY_BYTES`, 413) and the headers; these bound what a small
body can still demand: outputs (`max_tokens`, `n`, `best_of`, log probabilities), how many prompts are tokenized, how deep the JSON nests, and
prompt plus output within the model's context. Each violation is an OpenAIError 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from coordinator.errors import OpenAIError


class RequestLimits(BaseModel):
    """`coordinator.limits`: the largest request the coordinator accepts."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(default=32768, gt=0)
    """Largest `max_tokens` / `max_completion_tokens` (per choice); a model's `max_model_len` may lower it."""
    max_n: int = Field(default=16, gt=0)
    """Largest `n` (choices per prompt)."""
    max_best_of: int = Field(default=16, gt=0)
    """Largest `best_of` (sequences generated per prompt, of which `n` are returned: each costs as much as a
    choice)."""
    max_logprobs: int = Field(default=20, gt=0)
    """Largest `logprobs` (completions), `top_logprobs` (chat) and `prompt_logprobs` (vLLM's extension; per prompt
    token): vLLM's own default `--max-logprobs`."""
    max_prompts: int = Field(default=64, gt=0)
    """Most prompts in one completions request (a list of prompts)."""
    max_messages: int = Field(default=4096, gt=0)
    """Most chat messages in one request."""
    max_json_depth: int = Field(default=32, gt=0)
    """Deepest nesting of objects and arrays in a body."""
    max_chars_per_token: int = Field(default=16, gt=0)
    """With a model's `max_model_len`, a prompt longer than this many characters per token of context is refused
    before it is tokenized (tokenizing megabytes would hold the coordinator for seconds)."""
    max_prompt_chars: int = Field(default=2 * 1024 * 1024, gt=0)
    """Longest prompt in characters (all prompts or messages of a request together) for every model, also one
    without `max_model_len`: refused before it is tokenized or reaches an engine."""


def json_depth(value: Any, limit: int) -> int:
    """The nesting depth of a parsed document, counting stops at `limit + 1` (iterative: no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _int_field(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_body(api: str, body: dict[str, Any], limits: RequestLimits) -> None:
    """Checks a parsed body before it is tokenized; OpenAIError 400 naming the field."""
    if json_depth(body, limits.max_json_depth) > limits.max_json_depth:
        raise OpenAIError(
            400, f"The request body nests JSON deeper than {limits.max_json_depth} levels.", None
        )
    for key in ("max_tokens", "max_completion_tokens"):
        value = _int_field(body, key)
        if value is not None and value > limits.max_tokens:
            raise OpenAIError(400, f"`{key}` is {value}; at most {limits.max_tokens} is allowed.", key)
    for key, limit in (
        ("n", limits.max_n),
        ("best_of", limits.max_best_of),
        ("logprobs", limits.max_logprobs),
        ("top_logprobs", limits.max_logprobs),
        ("prompt_logprobs", limits.max_logprobs),
    ):
        value = _int_field(body, key)
        if value is not None and value > limit:
            raise OpenAIError(400, f"`{key}` is {value}; at most {limit} is allowed.", key)
    if api == "chat.completions":
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > limits.max_messages:
            raise OpenAIError(
                400, f"{len(messages)} messages; at most {limits.max_messages} are allowed.", "messages"
            )
        return
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) > limits.max_prompts:
            raise OpenAIError(
                400,
                f"{len(prompt)} prompts; at most {limits.max_prompts} are allowed in one request.",
                "prompt",
            )


def prompt_chars(api: str, body: dict[str, Any]) -> int:
    """The size of the prompt text (characters; token ids count one each), without tokenizing."""
    if api == "chat.completions":
        total = 0
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, str | list) else 1 for p in prompt)
    return 0


def check_prompt_size(
    api: str, body: dict[str, Any], max_model_len: int | None, limits: RequestLimits, model: str
) -> None:
    """Refuses (400) a prompt far beyond the model's context, or longer than `max_prompt_chars`, before tokenizing
    it."""
    chars = prompt_chars(api, body)
    param = "messages" if api == "chat.completions" else "prompt"
    if max_model_len and chars > max_model_len * limits.max_chars_per_token:
        raise OpenAIError(
            400,
            f"The prompt ({chars} characters) cannot fit the {max_model_len} tokens `{model}` takes "
            "(max_model_len).",
            param,
        )
    if chars > limits.max_prompt_chars:
        raise OpenAIError(
            400,
            f"The prompt ({chars} characters) is longer than the {limits.max_prompt_chars} characters this "
            "server accepts (max_prompt_chars).",
            param,
        )


def check_context(
    prompts: list[list[int]], max_tokens: int | None, max_model_len: int | None, model: str
) -> None:
    """Prompt plus output within the model's context (when the mesh file gives `max_model_len`), as vLLM checks."""
    if not max_model_len:
        return
    longest = max((len(p) for p in prompts), default=0)
    if longest > max_model_len:
        raise OpenAIError(
            400,
            f"The prompt has {longest} tokens; `{model}` takes at most {max_model_len} (max_model_len).",
            "prompt",
        )
    if max_tokens is not None and longest + max_tokens > max_model_len:
        raise OpenAIError(
            400,
            f"The prompt ({longest} tokens) plus max_tokens ({max_tokens}) is more than the {max_model_len} "
            f"tokens `{model}` takes (max_model_len).",
            "max_tokens",
        )
