"""Request attempts of decode-first trigger mode (`concurrent_engine_sync`), and their callback rules.

An attempt is one try at serving a client request on a decode engine: it has the request id the engines see
(`<root>#a<n>`), the callback ids the decode engine will post (`chatcmpl-<id>`, or `cmpl-<id>-<i>` per prompt),
the workload it holds, and at most one prefill leg. The rules:
- a callback for an unknown, closed or superseded attempt is rejected (the caller answers NOT_FOUND) and never
  reaches a newer attempt of the same request;
- callbacks of one attempt are serialised: the prefill leg starts once every expected child has called back, and
  exactly once; a duplicate after the leg completed succeeds at once;
- closing the attempt (client gone, decode finished or failed) cancels an in-flight prefill leg; the caller
  releases the attempt's workload exactly once.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


class AttemptState(enum.Enum):
    """Where an attempt is."""

    WAITING = 1  # for the decode engine's callbacks
    PREFILLING = 2  # the prefill leg runs
    DONE = 3  # the prefill leg completed
    FAILED = 4  # the prefill leg failed
    CLOSED = 5  # the request ended (or a newer attempt superseded this one)


class UnknownAttempt(Exception):
    """No open attempt expects this callback id."""


class PrefillLegFailed(Exception):
    """The attempt's prefill leg failed; the message says why."""


def callback_ids(api: str, engine_request_id: str, prompts: int) -> list[str]:
    """The `request_id`s a vLLM-Ascend decode engine posts for a request sent with `X-Request-Id: id`."""
    if api == "chat.completions":
        return [f"chatcmpl-{engine_request_id}"]
    return [f"cmpl-{engine_request_id}-{i}" for i in range(prompts)]


@dataclass
class Attempt:
    """One attempt of one request."""

    root_id: str
    number: int
    api: str
    expected: list[str]
    context: Any = None  # what the caller needs to run the prefill leg (the routing decision)
    state: AttemptState = AttemptState.WAITING
    facts: dict[str, dict] = field(default_factory=dict)  # callback id -> the decode engine's facts
    leg: asyncio.Task | None = None
    outcome: asyncio.Future | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    opened_at: float = field(default_factory=time.monotonic)  # when the decode request went out
    token: str = ""  # in the callback URL: only the decode engine of this attempt knows it

    @property
    def engine_request_id(self) -> str:
        """The `X-Request-Id` the engines get: the root id and the attempt number."""
        return f"{self.root_id}#a{self.number}"

    @property
    def open(self) -> bool:
        return self.state is not AttemptState.CLOSED


class AttemptRegistry:
    """Open attempts by callback id; the newest attempt number per root request id."""

    def __init__(self) -> None:
        self._by_callback: dict[str, Attempt] = {}
        self._newest: dict[str, Attempt] = {}
        self._numbers: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._newest)

    def open(self, root_id: str, api: str, prompts: int, context: Any = None) -> Attempt:
        """A new attempt for `root_id`; an older open attempt of the same request is superseded (closed)."""
        number = self._numbers.get(root_id, 0) + 1
        self._numbers[root_id] = number
        older = self._newest.get(root_id)
        if older is not None:
            self.close(older)
            self._numbers[root_id] = number  # closing the older one forgot the count: keep numbering up
        attempt = Attempt(root_id, number, api, [], context)
        attempt.expected = callback_ids(api, attempt.engine_request_id, prompts)
        for cid in attempt.expected:
            self._by_callback[cid] = attempt
        self._newest[root_id] = attempt
        return attempt

    def find(self, callback_id: str) -> Attempt:
        """The open attempt expecting `callback_id`; UnknownAttempt otherwise."""
        attempt = self._by_callback.get(callback_id)
        if attempt is None or not attempt.open:
            raise UnknownAttempt(f"no open request attempt expects a callback for {callback_id!r}")
        return attempt

    def close(self, attempt: Attempt) -> bool:
        """Closes an attempt: cancels its prefill leg and forgets it. True the first time only."""
        if attempt.state is AttemptState.CLOSED:
            return False
        attempt.state = AttemptState.CLOSED
        if attempt.leg is not None and not attempt.leg.done():
            attempt.leg.cancel()
        if attempt.outcome is not None and not attempt.outcome.done():
            attempt.outcome.set_exception(
                PrefillLegFailed("the request ended before its prefill leg completed")
            )
            attempt.outcome.exception()  # retrieved: nobody may be waiting
        for cid in attempt.expected:
            if self._by_callback.get(cid) is attempt:
                del self._by_callback[cid]
        if self._newest.get(attempt.root_id) is attempt:
            del self._newest[attempt.root_id]
            self._numbers.pop(attempt.root_id, None)
        return True

    async def callback(
        self, callback_id: str, facts: dict, run_leg: Callable[[Attempt], Awaitable[None]]
    ) -> None:
        """Records one callback; starts the prefill leg when every expected child has called back; returns when
        the leg completed (raises PrefillLegFailed, or UnknownAttempt for an unknown/closed attempt)."""
        attempt = self.find(callback_id)
        async with attempt.lock:
            if not attempt.open:
                raise UnknownAttempt(f"the request attempt of {callback_id!r} has ended")
            if attempt.state is AttemptState.DONE:
                return  # a duplicate after the leg completed
            attempt.facts.setdefault(callback_id, facts)
            if attempt.outcome is None:
                attempt.outcome = asyncio.get_running_loop().create_future()
            if attempt.state is AttemptState.WAITING and all(c in attempt.facts for c in attempt.expected):
                attempt.state = AttemptState.PREFILLING
                attempt.leg = asyncio.create_task(self._run(attempt, run_leg))
            outcome = attempt.outcome
        await asyncio.shield(outcome)

    async def _run(self, attempt: Attempt, run_leg: Callable[[Attempt], Awaitable[None]]) -> None:
        outcome = attempt.outcome
        assert outcome is not None  # created before the leg starts
        try:
            await run_leg(attempt)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the leg failed: every waiting callback gets the error
            if attempt.open:
                attempt.state = AttemptState.FAILED
            if not outcome.done():
                outcome.set_exception(PrefillLegFailed(str(exc)))
            return
        if attempt.open:
            attempt.state = AttemptState.DONE
        if not outcome.done():
            outcome.set_result(None)
