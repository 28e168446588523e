"""The answer-encoder interface: what the serving layer asks of one OpenAI API's answer shapes. Nothing else lives
here but the per-choice state both sides read.

The serving layer runs the request (engine output, stop strings, echo, waiting) the same way for every API and
hands each answer's pieces to the API's encoder: `stream` gives the chunk encoder of one streamed answer (bytes
ready to write, built by concatenating precomputed byte pieces: the per-token path must stay cheap), `body` the
whole answer of a non-streamed one (a dict the caller encodes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from simengine.logprobs import LogprobsBuilder
from simengine.protocol import Params
from simengine.request import Request


class Choice:
    """Output state of one choice (one sequence) as the serving layer consumes it and the encoders shape it."""

    __slots__ = ("req", "index", "pending", "text", "held", "finished", "started", "emitted", "offset")

    def __init__(self, req: Request, index: int) -> None:
        #: The engine's sequence.
        self.req = req
        #: The choice's `index` in the answer (prompt index times n, plus the choice's number).
        self.index = index
        #: Output tokens delivered by the engine and not yet consumed.
        self.pending: list[int] = []
        #: Text consumed so far and not yet sent (streamed with stop strings) or to send (whole answers).
        self.text: list[str] = []
        #: Streamed text held back while it could still become a stop string.
        self.held = ""
        #: The engine finished the sequence, or a stop string ended it.
        self.finished = False
        #: The choice's first chunk was sent (chat: its role chunk; completions: the echoed prompt leads it).
        self.started = False
        #: Output tokens already streamed (their positions number the next logprobs).
        self.emitted = 0
        #: Completions logprobs: text offset of the next streamed token.
        self.offset = 0

    def answer_text(self) -> str:
        """The whole text of a finished, non-streamed choice."""
        return "".join(self.text) + self.held


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP request's answer, as its encoder sees it."""

    #: The model the answer names (the request's `model`, else the first served name).
    model: str
    #: The request's validated parameters.
    params: Params
    #: The id suffix: ids are `cmpl-<base>` / `chatcmpl-<base>` (the X-Request-Id, else random hex).
    base: str
    #: The answer's choices, in order.
    choices: list[Choice]


@dataclass(frozen=True, slots=True)
class EncoderTools:
    """What encoders take from the serving layer, once per process."""

    #: Simulated logprobs in vLLM's shapes.
    logprobs: LogprobsBuilder
    #: Token ids to text (an echoed prompt).
    decode: Callable[[list[int]], str]
    #: vLLM's `system_fingerprint` (its version plus a per-process hash).
    fingerprint: str


class ChunkStream(Protocol):
    """The SSE chunks of one streamed answer, each `data: {...}\\n\\n` bytes."""

    def opening(self) -> list[bytes]:
        """Chunks sent before any token (marks the choices `started` when it sends one per choice)."""
        ...

    def token(
        self, n: int, choice: Choice, text: bytes, tokens: list[int], final: bool, prompt_ids: bytes
    ) -> bytes:
        """The chunk of `choice` (the answer's `n`th) carrying `text` (JSON-encoded) for `tokens`; `final` on the
        choice's last chunk; `prompt_ids` the JSON-encoded echoed prompt ids on a completions first chunk, else
        `null`."""
        ...

    def usage(self, prompt_tokens: int, completion_tokens: int, prompt_details: dict | None = None) -> bytes:
        """The closing usage chunk (`stream_options.include_usage`); `prompt_details` its
        `prompt_tokens_details` (`--enable-prompt-tokens-details`), left out when None."""
        ...


class ApiEncoder(Protocol):
    """One OpenAI API's answer shapes."""

    #: The API's name as the routes give it: "completions" or "chat.completions".
    api: str

    def callback_id(self, base: str, prompt_index: int) -> str:
        """vLLM's request id of a prompt of the answer `base` names (the id a metaserver callback carries)."""
        ...

    def stream(self, answer: Answer) -> ChunkStream:
        """The chunk encoder of one streamed answer (its `created` time is now)."""
        ...

    def body(self, answer: Answer, usage: dict, kv_params: dict | None) -> dict:
        """The whole answer once its choices finished (its `created` time is now), with the request's `usage`
        and the `kv_transfer_params` its P/D connector answers."""
        ...
