"""What every streamed chunk of one answer shares, whatever its API: the precomputed byte prefixes (`data: {"id":
..,"object":..,"created":..,"model":..,"choices":[{"index":N`), the fingerprint placement and the usage parts."""

from __future__ import annotations

import time

from simengine.encoders.interface import Answer, Choice
from simengine.protocol import encode
from simengine.request import Request


class StreamFrame:
    """Byte pieces of one streamed answer; the API's chunk encoders extend it with their chunk layouts."""

    __slots__ = ("top", "heads", "k", "continuous", "fp", "fp_on_finish")

    def __init__(self, answer: Answer, rid: str, object_name: bytes, fp: bytes) -> None:
        params = answer.params
        #: Every chunk's start, up to its choices.
        self.top = (
            b'data: {"id":' + encode(rid) + b',"object":"' + object_name + b'","created":'
            + str(int(time.time())).encode() + b',"model":' + encode(answer.model)
        )  # fmt: skip
        head = self.top + b',"choices":[{"index":'
        #: Per choice (in answer order): its chunks' start, up to its index.
        self.heads = [head + str(c.index).encode() for c in answer.choices]
        #: Logprobs per token (completions `logprobs`, chat `top_logprobs`); None: off.
        self.k = params.logprobs
        #: `continuous_usage_stats`: every chunk carries its choice's usage so far.
        self.continuous = params.include_usage and params.continuous_usage
        #: `,"system_fingerprint":"..."`: closes the usage chunk, or each choice's last chunk when none follows.
        self.fp = fp
        self.fp_on_finish = b"" if params.include_usage else fp

    def usage(self, prompt_tokens: int, completion_tokens: int, prompt_details: dict | None = None) -> bytes:
        usage: dict = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                       "completion_tokens": completion_tokens}  # fmt: skip
        if prompt_details is not None:  # vLLM's stream leaves the key out unless it reports the details
            usage["prompt_tokens_details"] = prompt_details
        return self.top + b',"choices":[],"usage":' + encode(usage) + self.fp + b"}\n\n"


def running_usage(choice: Choice, details: bool) -> bytes:
    """`,"usage":{..}` of a choice so far (continuous usage); chat's adds `completion_tokens_details`."""
    p, c = len(choice.req.prompt_token_ids), choice.emitted
    usage: dict[str, int | None] = {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c}
    if details:
        usage["completion_tokens_details"] = None
    return b',"usage":' + encode(usage)


def finish(req: Request) -> bytes:
    """`,"finish_reason":..,"stop_reason":..` of a choice's last chunk."""
    return (
        b',"finish_reason":'
        + encode(req.finish_reason or "stop")
        + b',"stop_reason":'
        + encode(req.stop_reason)
    )
