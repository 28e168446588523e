"""`/v1/completions` answers as vLLM 0.32 shapes them.

Streamed: one chunk per token (`prompt_token_ids` and `token_ids` null; an echoed prompt's ids on the choice's
first chunk, its text leading the chunk's), `stop_reason` on every chunk, the finish reason on the choice's last.
Whole: `text` (after the echoed prompt), `logprobs` (the echoed prompt's first), `prompt_logprobs` with echo and
logprobs.
"""

from __future__ import annotations

import time

from simengine.encoders.frame import StreamFrame, finish, running_usage
from simengine.encoders.interface import Answer, Choice, EncoderTools
from simengine.protocol import encode

API = "completions"
_NOT_FINISHED = b',"finish_reason":null,"stop_reason":null'


class CompletionsStream(StreamFrame):
    """The chunks of one streamed completion."""

    __slots__ = ("tools",)

    def __init__(self, tools: EncoderTools, fp: bytes, answer: Answer) -> None:
        super().__init__(answer, f"cmpl-{answer.base}", b"text_completion", fp)
        self.tools = tools

    def opening(self) -> list[bytes]:
        return []

    def token(
        self, n: int, choice: Choice, text: bytes, tokens: list[int], final: bool, prompt_ids: bytes
    ) -> bytes:
        logprobs = b"null"
        if self.k is not None and tokens:
            d = self.tools.logprobs.completion(choice.req.params.seed_key, tokens, choice.emitted, self.k,
                                               choice.offset)  # fmt: skip
            choice.offset = d["text_offset"][-1] + len(d["tokens"][-1])
            logprobs = encode(d)
        choice.emitted += len(tokens)
        if final:
            end = finish(choice.req)
            tail = self.fp_on_finish + b"}\n\n"
        else:
            end = _NOT_FINISHED
            tail = b"}\n\n"
        out = (self.heads[n] + b',"text":' + text + b',"logprobs":' + logprobs + end + b',"prompt_token_ids":'
               + prompt_ids + b',"token_ids":null}]')  # fmt: skip
        if self.continuous:
            return out + running_usage(choice, False) + tail
        return out + tail


class CompletionsEncoder:
    """`/v1/completions`: `text_completion` bodies and chunks, ids `cmpl-<base>`."""

    api = API

    def __init__(self, tools: EncoderTools) -> None:
        self.tools = tools
        self._fp = b',"system_fingerprint":' + encode(tools.fingerprint)

    def callback_id(self, base: str, prompt_index: int) -> str:
        return f"cmpl-{base}-{prompt_index}"

    def stream(self, answer: Answer) -> CompletionsStream:
        return CompletionsStream(self.tools, self._fp, answer)

    def body(self, answer: Answer, usage: dict, kv_params: dict | None) -> dict:
        created = int(time.time())
        params = answer.params
        lp = self.tools.logprobs
        k = params.logprobs
        out = []
        for choice in answer.choices:
            req = choice.req
            key = req.params.seed_key
            text = choice.answer_text()
            prompt = req.prompt_token_ids if params.echo else None
            if params.echo:
                text = self.tools.decode(req.prompt_token_ids) + text
            logprobs = lp.completion(key, req.output_token_ids, 0, k, 0, prompt) if k is not None else None
            prompt_lp = (
                lp.prompt_logprobs(key, req.prompt_token_ids, k) if (k is not None and params.echo) else None
            )
            out.append({"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": req.finish_reason,
                        "stop_reason": req.stop_reason, "token_ids": None, "prompt_logprobs": prompt_lp,
                        "prompt_token_ids": None, "routed_experts": None})  # fmt: skip
        return {"id": f"cmpl-{answer.base}", "object": "text_completion", "created": created, "model": answer.model,
                "choices": out, "service_tier": None, "system_fingerprint": self.tools.fingerprint, "usage": usage,
                "kv_transfer_params": kv_params, "ec_transfer_params": None, "metrics": None}  # fmt: skip


def create(tools: EncoderTools) -> CompletionsEncoder:
    """Factory used by the encoder registry."""
    return CompletionsEncoder(tools)
