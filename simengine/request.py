"""The engine's view of one sequence (one choice of one OpenAI request): tokens, progress, blocks, P/D state."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NewType

from simengine.lora import LoraAdapter

#: A block's chain hash as published on the wire (vLLM's int form: an unsigned 64-bit integer).
BlockHash = NewType("BlockHash", int)


class Status(enum.Enum):
    """Where a request is in its life (vLLM's RequestStatus, trimmed)."""

    WAITING = "waiting"
    #: Blocks allocated; waiting for a remote engine to deliver the prompt's KV (P/D decode side).
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"


@dataclass(slots=True)
class SamplingParams:
    """What decides the output tokens; only `seed_key` and the limits matter to the simulated sampler."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    #: Stop strings; the answer is cut before the first one found.
    stop: tuple[str, ...] = ()
    #: Hash of (temperature, top_p, top_k, seed, choice index): with the prompt it fixes the output tokens.
    seed_key: int = 0


@dataclass(slots=True, eq=False)
class Request:
    """One sequence in the engine. Identity-compared: two requests are never equal."""

    #: Engine-internal id: the external id plus "-" and 8 hex digits, as vLLM does.
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    #: Tokens whose KV is in this engine's cache (computed, loaded from a tier, or transferred).
    num_computed_tokens: int = 0
    #: Prompt tokens found in the prefix cache at first scheduling (NPU + lower tiers).
    num_cached_tokens: int = -1
    #: Block ids held on the NPU, in order.
    block_ids: list[int] = field(default_factory=list)
    #: Chain hashes of the full blocks of prompt + output so far (the 64-bit event form).
    block_hashes: list[BlockHash] = field(default_factory=list)
    #: The same hashes as full digests: the chain goes on from these (vLLM hashes the parent's digest).
    block_digests: list[bytes] = field(default_factory=list)
    #: vLLM's `cache_salt`: an extra hash key of the first block, so salted prompts share nothing unsalted.
    cache_salt: str | None = None
    #: The LoRA adapter the request names as `model` (None: the base model). Its name and path key every block
    #: hash, as vLLM's `("lora", name, path)` extra key.
    lora: LoraAdapter | None = None
    #: vLLM's `priority` (smaller first under `--scheduling-policy priority`; ignored under `fcfs`).
    priority: int = 0
    #: Leading blocks of `block_ids` already cached under their hashes.
    num_cached_blocks: int = 0
    #: Bytes to load from CPU / disk in the step that schedules this request (set by the KV cache manager).
    load_tokens_cpu: int = 0
    load_tokens_disk: int = 0
    #: Set by P/D connectors.
    kv_transfer_params: dict[str, Any] | None = None
    #: Decode side: KV expected from a remote engine; `remote_kv_done` set when it arrived (or failed).
    needs_remote_kv: bool = False
    remote_kv_done: bool = False
    remote_kv_ok: bool = False
    #: Leading prompt tokens whose KV the remote engine delivered (full blocks; the rest is computed here).
    num_remote_tokens: int = 0
    #: Prefill side (handoff): keep blocks after finishing until the decode engine pulled them.
    hold_blocks_for_remote: bool = False
    num_external_tokens: int = 0
    #: Trigger mode: the request id the metaserver callback names (internal id minus its 9-char suffix).
    pd_callback_id: str = ""
    #: The W3C trace context of the request's span when traced ("" otherwise): its metaserver callback joins it.
    traceparent: str = ""
    num_preemptions: int = 0
    #: When the scheduler first gave the request compute (monotonic; 0 until then): ends its queue time.
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | None = None
    #: Called by the engine with (request, new token ids, finished) after every step that produced output.
    on_output: Callable[[Request, list[int], bool], None] | None = None
    #: Free for the serving layer.
    user: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]


_FINISHED = {
    Status.FINISHED_STOPPED,
    Status.FINISHED_LENGTH,
    Status.FINISHED_ABORTED,
    Status.FINISHED_ERROR,
}
