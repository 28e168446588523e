"""Restarting a process that exits (pure: no processes, no clock of its own), for `tandem up`'s components and the
node agent's engines alike.

A process that exits is started again after a backoff that doubles with each quick exit in a row (initial, 2x,
... capped); the first exit of a row (a crash after a stable run, or the first one ever) is restarted after
`first_restart_s` instead, which `tandem up` sets to 0: a component killed once is back at once, and only a crash
loop waits. A run that lasted `stable_after_s` resets the count, so exits far apart never add up. After
`failed_after` quick exits in a row the tracker says FAILED; what follows is the caller's: `tandem up` still retries
every `max_backoff_s` (the mesh never stops because one component keeps failing), the node agent leaves the engine
FAILED until an operator launches it again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class BackoffPolicy(Protocol):
    """The numbers a tracker follows. Each config section keeps its own keys and defaults (`up.restart` in the mesh
    file, `restart` of a node agent) and only has to offer these five."""

    @property
    def first_restart_s(self) -> float:
        """Delay before the restart after the first exit of a row (not yet a crash loop)."""
        ...

    @property
    def initial_backoff_s(self) -> float:
        """The backoff the doubling starts from: the second quick exit in a row waits twice this."""
        ...

    @property
    def max_backoff_s(self) -> float:
        """Cap of the doubling delay; also the retry interval of a FAILED process that is still retried."""
        ...

    @property
    def stable_after_s(self) -> float:
        """A run at least this long resets the count of quick exits."""
        ...

    @property
    def failed_after(self) -> int:
        """Quick exits in a row after which the process is FAILED."""
        ...


class RestartState(enum.Enum):
    """Where a process is in its restart cycle (the values are what `tandem up` writes to status.json)."""

    STARTING = "starting"  # launched, not yet stable
    RUNNING = "running"  # up for `stable_after_s`
    BACKOFF = "backoff"  # exited; restart scheduled
    FAILED = "failed"  # exited quickly `failed_after` times in a row


def backoff_delay(policy: BackoffPolicy, quick_exits: int) -> float:
    """`first_restart_s` for the first exit of a row, then exponential: 2x initial, 4x initial, ... capped at
    `max_backoff_s`."""
    if quick_exits <= 1:
        return min(policy.max_backoff_s, policy.first_restart_s)
    return min(policy.max_backoff_s, policy.initial_backoff_s * 2 ** (quick_exits - 1))


@dataclass
class RestartTracker:
    """The restart state of one process."""

    policy: BackoffPolicy
    state: RestartState = RestartState.STARTING
    quick_exits: int = 0  # exits in a row of runs shorter than `stable_after_s`
    restarts: int = 0  # restarts so far, counted by the caller when it starts the process again
    started_at: float = 0.0  # when the current run started (the caller's clock)
    restart_at: float | None = None  # when to start it again (BACKOFF, FAILED)

    def reset(self) -> None:
        """Forgets the quick exits: a fresh start asked for by an operator, not a restart."""
        self.state = RestartState.STARTING
        self.quick_exits = 0
        self.restart_at = None

    def started(self, now: float) -> None:
        """The process was (re)started at `now`."""
        self.started_at = now
        self.restart_at = None
        if self.state is not RestartState.FAILED:
            self.state = RestartState.STARTING

    def tick(self, now: float) -> bool:
        """Called while the process runs; True when it just became stable (its budget is reset)."""
        if self.restart_at is None and now - self.started_at >= self.policy.stable_after_s:
            if self.state is not RestartState.RUNNING:
                self.state = RestartState.RUNNING
                self.quick_exits = 0
                return True
        return False

    def exited(self, now: float) -> float:
        """The process exited at `now`: schedules the restart and returns the delay (`max_backoff_s` once FAILED)."""
        ran = now - self.started_at
        self.quick_exits = 1 if ran >= self.policy.stable_after_s else self.quick_exits + 1
        delay = backoff_delay(self.policy, self.quick_exits)
        if self.quick_exits >= self.policy.failed_after:
            self.state = RestartState.FAILED
            delay = self.policy.max_backoff_s
        else:
            self.state = RestartState.BACKOFF
        self.restart_at = now + delay
        return delay

    def due(self, now: float) -> bool:
        """True when a scheduled restart is due."""
        return self.restart_at is not None and now >= self.restart_at
