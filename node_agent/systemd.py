"""systemd integration: `Type=notify` readiness and watchdog keep-alives through `sdnotify`.

Only active when systemd started us (`NOTIFY_SOCKET` set). READY=1 is sent once the NodeAgent gRPC service
answers and the services are launched (engines may still be loading weights: their state is in GetStatus);
WATCHDOG=1 every half `WATCHDOG_USEC` while the event loop turns, so a wedged agent is restarted by systemd.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping

import sdnotify


class SystemdNotify:
    """Readiness, status and watchdog notifications; every method is a no-op outside systemd."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.enabled = bool(env.get("NOTIFY_SOCKET"))
        self._notifier = sdnotify.SystemdNotifier() if self.enabled else None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        self.watchdog_interval_s = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and mine else None
        self.sent: list[str] = []  # for tests

    def notify(self, state: str) -> None:
        if self._notifier is not None:
            self._notifier.notify(state)
            self.sent.append(state)

    def ready(self, status: str) -> None:
        """READY=1 with a human-readable STATUS line (shown by `systemctl status`)."""
        self.notify(f"READY=1\nSTATUS={status}")

    def stopping(self) -> None:
        self.notify("STOPPING=1")

    async def watchdog(self) -> None:
        """Sends WATCHDOG=1 until cancelled (returns at once when systemd asked for no watchdog)."""
        if self.watchdog_interval_s is None or self._notifier is None:
            return
        while True:
            self.notify("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval_s)
