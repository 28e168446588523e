"""`/v1/chat/completions` answers as vLLM 0.32 shapes them.

Streamed: a role chunk per choice first (with top-level `prompt_token_ids` / `prompt_text` null), then token
chunks (`delta.content`); `stop_reason` only on each choice's last chunk, with its finish reason; continuous
usage carries `completion_tokens_details`. Whole: an assistant `message` per choice and the top-level
`prompt_logprobs`, `prompt_token_ids` and `prompt_text` (null).
"""

from __future__ import annotations

import time

from simengine.encoders.frame import StreamFrame, finish, running_usage
from simengine.encoders.interface import Answer, Choice, EncoderTools
from simengine.protocol import encode

API = "chat.completions"
_ROLE = b',"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]'
_ROLE_END = b',"prompt_token_ids":null,"prompt_text":null}\n\n'


class ChatStream(StreamFrame):
    """The chunks of one streamed chat completion."""

    __slots__ = ("tools", "choices")

    def __init__(self, tools: EncoderTools, fp: bytes, answer: Answer) -> None:
        super().__init__(answer, f"chatcmpl-{answer.base}", b"chat.completion.chunk", fp)
        self.tools = tools
        self.choices = answer.choices

    def opening(self) -> list[bytes]:
        parts = []
        for n, choice in enumerate(self.choices):
            choice.started = True
            usage = running_usage(choice, True) if self.continuous else b""
            parts.append(self.heads[n] + _ROLE + usage + _ROLE_END)
        return parts

    def token(
        self, n: int, choice: Choice, text: bytes, tokens: list[int], final: bool, prompt_ids: bytes
    ) -> bytes:
        logprobs = b"null"
        if self.k is not None and tokens:
            logprobs = encode(
                self.tools.logprobs.chat(choice.req.params.seed_key, tokens, choice.emitted, self.k)
            )
        choice.emitted += len(tokens)
        if final:
            end = finish(choice.req)
            tail = self.fp_on_finish + b"}\n\n"
        else:
            end = b',"finish_reason":null'
            tail = b"}\n\n"
        out = (
            self.heads[n]
            + b',"delta":{"content":'
            + text
            + b'},"logprobs":'
            + logprobs
            + end
            + b',"token_ids":null}]'
        )
        if self.continuous:
            return out + running_usage(choice, True) + tail
        return out + tail


class ChatEncoder:
    """`/v1/chat/completions`: `chat.completion` bodies and `chat.completion.chunk` chunks, ids `chatcmpl-<base>`."""

    api = API

    def __init__(self, tools: EncoderTools) -> None:
        self.tools = tools
        self._fp = b',"system_fingerprint":' + encode(tools.fingerprint)

    def callback_id(self, base: str, prompt_index: int) -> str:
        return f"chatcmpl-{base}"  # one prompt per chat request

    def stream(self, answer: Answer) -> ChatStream:
        return ChatStream(self.tools, self._fp, answer)

    def body(self, answer: Answer, usage: dict, kv_params: dict | None) -> dict:
        created = int(time.time())
        params = answer.params
        lp = self.tools.logprobs
        k = params.logprobs
        out = []
        for choice in answer.choices:
            req = choice.req
            message = {"role": "assistant", "content": choice.answer_text(), "refusal": None, "annotations": None,
                       "audio": None, "function_call": None, "reasoning": None}  # fmt: skip
            logprobs = lp.chat(req.params.seed_key, req.output_token_ids, 0, k) if k is not None else None
            out.append({"index": choice.index, "message": message, "logprobs": logprobs,
                        "finish_reason": req.finish_reason, "stop_reason": req.stop_reason, "token_ids": None,
                        "routed_experts": None})  # fmt: skip
        return {"id": f"chatcmpl-{answer.base}", "object": "chat.completion", "created": created, "model": answer.model,
                "choices": out, "service_tier": None, "system_fingerprint": self.tools.fingerprint, "usage": usage,
                "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
                "kv_transfer_params": kv_params, "ec_transfer_params": None, "metrics": None}  # fmt: skip


def create(tools: EncoderTools) -> ChatEncoder:
    """Factory used by the encoder registry."""
    return ChatEncoder(tools)
