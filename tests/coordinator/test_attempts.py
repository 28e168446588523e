"""Lifecycle rules of decode-first trigger attempts, one test per rule."""

import asyncio

import pytest

from coordinator.attempts import AttemptRegistry, AttemptState, PrefillLegFailed, UnknownAttempt, callback_ids
from tests.helpers import eventually


class Legs:
    """A fake prefill leg runner that counts legs and can be held, failed or released."""

    def __init__(self, fail: bool = False) -> None:
        self.started = 0
        self.release = asyncio.Event()
        self.fail = fail
        self.cancelled = 0

    async def __call__(self, attempt) -> None:
        self.started += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.fail:
            raise RuntimeError("prefill engine answered 500")


def test_callback_ids_follow_vllm_ascend():
    assert callback_ids("chat.completions", "abc#a1", 1) == ["chatcmpl-abc#a1"]
    assert callback_ids("completions", "abc#a1", 2) == ["cmpl-abc#a1-0", "cmpl-abc#a1-1"]


async def test_unknown_callback_is_rejected():
    with pytest.raises(UnknownAttempt):
        await AttemptRegistry().callback("cmpl-nope-0", {}, Legs())


async def test_concurrent_duplicates_start_one_leg_and_all_succeed():
    registry, legs = AttemptRegistry(), Legs()
    attempt = registry.open("r", "completions", 1)
    cid = attempt.expected[0]
    calls = [asyncio.create_task(registry.callback(cid, {"n": i}, legs)) for i in range(3)]
    await eventually(lambda: legs.started == 1)  # the leg task runs after the three callbacks went through
    assert attempt.state is AttemptState.PREFILLING
    legs.release.set()
    await asyncio.gather(*calls)
    assert legs.started == 1 and attempt.state is AttemptState.DONE
    assert attempt.facts[cid] == {"n": 0}  # the first callback's facts


async def test_duplicate_after_completion_succeeds_without_a_second_leg():
    registry, legs = AttemptRegistry(), Legs()
    legs.release.set()
    attempt = registry.open("r", "chat.completions", 1)
    await registry.callback(attempt.expected[0], {}, legs)
    await registry.callback(attempt.expected[0], {}, legs)
    assert legs.started == 1


async def test_multi_prompt_waits_for_every_child_then_starts_once():
    registry, legs = AttemptRegistry(), Legs()
    legs.release.set()
    attempt = registry.open("r", "completions", 2)
    first = asyncio.create_task(registry.callback(attempt.expected[0], {"c": 0}, legs))
    await eventually(lambda: attempt.expected[0] in attempt.facts)  # recorded; the leg would start right here
    assert legs.started == 0 and not first.done() and attempt.state is AttemptState.WAITING
    await registry.callback(attempt.expected[1], {"c": 1}, legs)
    await first
    assert legs.started == 1 and set(attempt.facts) == set(attempt.expected)


async def test_superseded_attempt_is_rejected_and_never_reaches_the_newer_one():
    registry, legs = AttemptRegistry(), Legs()
    old = registry.open("r", "completions", 1)
    new = registry.open("r", "completions", 1)
    assert old.state is AttemptState.CLOSED and new.number == 2
    assert old.expected != new.expected
    with pytest.raises(UnknownAttempt):
        await registry.callback(old.expected[0], {}, legs)
    assert legs.started == 0 and new.facts == {}


async def test_closing_cancels_the_leg_in_flight_and_fails_waiters():
    registry, legs = AttemptRegistry(), Legs()
    attempt = registry.open("r", "completions", 1)
    call = asyncio.create_task(registry.callback(attempt.expected[0], {}, legs))
    await eventually(lambda: legs.started == 1)
    assert registry.close(attempt) is True and registry.close(attempt) is False
    await eventually(lambda: legs.cancelled == 1)
    with pytest.raises(PrefillLegFailed):
        await call
    with pytest.raises(UnknownAttempt):
        await registry.callback(attempt.expected[0], {}, legs)
    assert len(registry) == 0


async def test_failed_leg_fails_every_waiting_callback():
    registry, legs = AttemptRegistry(), Legs(fail=True)
    attempt = registry.open("r", "completions", 1)
    calls = [asyncio.create_task(registry.callback(attempt.expected[0], {}, legs)) for _ in range(2)]
    await eventually(lambda: legs.started == 1)  # after both callbacks went through
    legs.release.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, PrefillLegFailed) and "500" in str(r) for r in results)
    assert legs.started == 1 and attempt.state is AttemptState.FAILED
