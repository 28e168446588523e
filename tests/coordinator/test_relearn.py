"""The relearn window of a (re)started coordinator: no 503 for want of instances the agents have not registered
again yet, for `coordinator.relearn_s`; after it, 503 at once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from coordinator.decision import Decider
from coordinator.errors import OpenAIError
from coordinator.relearn import RelearnWindow
from tests.helpers import eventually


class Picker:
    """503 until an instance is there."""

    def __init__(self) -> None:
        self.ready = False
        self.calls = 0

    async def decide(self, api, raw_body, request_id, request, allowed=None):
        self.calls += 1
        if not self.ready:
            raise OpenAIError(503, "No healthy instance serves the model `m` right now; retry later.")
        return "pick"


async def test_a_decision_in_the_window_waits_for_the_next_registration():
    picker = Picker()
    window = RelearnWindow(5.0)
    decider = SimpleNamespace(picker=picker, relearn=window)
    decision = asyncio.create_task(Decider._decide(decider, "completions", b"{}", "r1", None))
    await eventually(lambda: picker.calls == 1, 2, "first try")
    assert not decision.done()  # waiting, not 503
    picker.ready = True
    window.registered()  # an agent registered again
    assert await asyncio.wait_for(decision, 2) == "pick" and picker.calls == 2


async def test_after_the_window_503_is_immediate():
    clock = [0.0]
    window = RelearnWindow(1.0, clock=lambda: clock[0])
    clock[0] = 1.5
    decider = SimpleNamespace(picker=Picker(), relearn=window)
    with pytest.raises(OpenAIError) as raised:
        await asyncio.wait_for(Decider._decide(decider, "completions", b"{}", "r1", None), 1)
    assert raised.value.status == 503
    # Other errors are never held, window or not.
    assert await RelearnWindow(0.05).wait_for_registration() is False  # bounded by the window


async def test_a_window_without_registrations_ends_in_503():
    decider = SimpleNamespace(picker=Picker(), relearn=RelearnWindow(0.2))
    with pytest.raises(OpenAIError):
        await asyncio.wait_for(Decider._decide(decider, "completions", b"{}", "r1", None), 2)
