"""Large request bodies are parsed and tokenized in worker processes, off the coordinator's event loop.

Tokenizing is CPU work in Python (the built-in tokenizer) or native code that may hold the interpreter lock: a
1 MiB prompt takes a few hundred milliseconds, during which an event loop doing it inline decides nothing else
(measured in `bench/decision_stall.py`; a thread pool did not help with the built-in tokenizer, the lock being
held). Bodies above `coordinator.decision_inline_bytes` go to a small process pool instead; smaller ones stay
inline, where they cost no inter-process hop. The workers hold their own tokenizers (loaded once per model) and
run the same pure function as the inline path (`coordinator.understanding.understand_body`).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from collections.abc import Collection, Mapping
from concurrent.futures import ProcessPoolExecutor

from coordinator.config import CoordinatorConfig
from coordinator.understanding import OpenAIRequest, TokenizerCache, understand_body
from tandem.tokenizer import load_tokenizer

_worker: tuple[TokenizerCache, CoordinatorConfig] | None = None  # in each worker process


def _init(tokenizer_paths: dict[str, str | None], config: CoordinatorConfig) -> None:
    global _worker
    _worker = (TokenizerCache(tokenizer_paths, load_tokenizer), config)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int, interval_s: float = 0.5) -> None:
    """A coordinator killed outright (SIGKILL, OOM) cannot stop its pool: the worker leaves when it sees its
    parent gone rather than linger (the pool's queues do not tell an idle worker)."""
    while os.getppid() == parent:
        time.sleep(interval_s)
    os._exit(0)


def _ready() -> bool:
    return _worker is not None


def _understand(
    api: str,
    raw_body: bytes,
    known_models: frozenset[str],
    max_model_len: dict[str, int],
    adapters: dict[str, str] | None = None,
) -> OpenAIRequest:
    assert _worker is not None
    tokenizers, config = _worker
    return understand_body(api, raw_body, known_models, tokenizers, config, max_model_len, adapters)


class UnderstandPool:
    """A process pool for `understand_body` (spawned processes: never forked from a gRPC server)."""

    def __init__(
        self, processes: int, tokenizer_paths: dict[str, str | None], config: CoordinatorConfig
    ) -> None:
        self._pool = ProcessPoolExecutor(
            processes,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init,
            initargs=(tokenizer_paths, config),
        )

    async def start(self) -> None:
        """Starts the workers now rather than on the first large body."""
        await asyncio.get_running_loop().run_in_executor(self._pool, _ready)

    async def understand(
        self,
        api: str,
        raw_body: bytes,
        known_models: Collection[str],
        max_model_len: Mapping[str, int] | None = None,
        adapters: Mapping[str, str] | None = None,
    ) -> OpenAIRequest:
        """`understand_body` in a worker, with the same request limits (a large body is where `check_prompt_size`
        matters most); raises OpenAIError as the inline path does. The models, their context lengths and their
        adapters (name -> base model) go with each call: a reloaded mesh file may change them."""
        models = frozenset(known_models)
        lengths = dict(max_model_len or {})
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, _understand, api, raw_body, models, lengths, dict(adapters or {})
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
