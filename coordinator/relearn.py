"""After a (re)start the coordinator knows no instance until the node agents register again (they reconnect within
a second). Requests decided in that window would get 503 "no healthy instance" although the engines serve: instead,
for `coordinator.relearn_s` after the start, a request whose model has no routable instance waits for the next
registration and is decided again. After the window, 503 is immediate as before.

`RelearnWindow` holds the rule (pure: the caller's clock); `wait_for_registration` is the asyncio side.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class RelearnWindow:
    """The window after a start in which decisions wait for registrations instead of answering 503."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.ends_at = clock() + window_s
        self._registered = asyncio.Event()

    def remaining(self) -> float:
        """Seconds left in the window (0 once it is over)."""
        return max(0.0, self.ends_at - self.clock())

    def registered(self) -> None:
        """An instance registered: wakes the waiting decisions (they try again)."""
        if self.remaining() > 0:
            self._registered.set()

    async def wait_for_registration(self) -> bool:
        """Waits for the next registration within the window; True when one came (decide again), False when the
        window is over (answer as usual)."""
        remaining = self.remaining()
        if remaining <= 0:
            return False
        self._registered.clear()
        try:
            async with asyncio.timeout(remaining):
                await self._registered.wait()
        except TimeoutError:
            return False
        return True
