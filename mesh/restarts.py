"""How `tandem up` restarts a component that exits (pure: no processes, no clock of its own).

A component that exits is started again after a backoff that doubles with each quick exit in a row (initial, 2x,
... capped). A run that lasted `stable_after_s` resets the count, so exits far apart never add up. After
`failed_after` quick exits in a row the component is reported FAILED, and still retried every `max_backoff_s`: the
mesh never stops because one component keeps failing (an etcd or a port that comes back heals it), and the others
keep serving meanwhile.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class RestartPolicy(BaseModel):
    """`up.restart`: how `tandem up` restarts a component (conductor, coordinator, Envoy, an agent) that exits."""

    model_config = ConfigDict(extra="forbid")

    initial_backoff_s: float = Field(default=0.5, gt=0)
    """Delay before the first restart after an exit."""
    max_backoff_s: float = Field(default=30.0, gt=0)
    """Cap of the doubling delay; also the retry interval of a FAILED component."""
    stable_after_s: float = Field(default=60.0, gt=0)
    """A run at least this long resets the count of quick exits."""
    failed_after: int = Field(default=5, ge=1)
    """Quick exits in a row after which the component is reported FAILED (it is still retried)."""


class ComponentState(enum.Enum):
    STARTING = "starting"  # launched, not yet stable
    RUNNING = "running"  # up for `stable_after_s`
    BACKOFF = "backoff"  # exited; restart scheduled
    FAILED = "failed"  # exited quickly `failed_after` times in a row; retried every `max_backoff_s`


@dataclass
class RestartTracker:
    """The restart state of one component."""

    policy: RestartPolicy
    state: ComponentState = ComponentState.STARTING
    quick_exits: int = 0  # exits in a row of runs shorter than `stable_after_s`
    restarts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None  # when to start it again (BACKOFF, FAILED)

    def started(self, now: float) -> None:
        """The component was (re)started at `now`."""
        self.started_at = now
        self.restart_at = None
        if self.state is not ComponentState.FAILED:
            self.state = ComponentState.STARTING

    def tick(self, now: float) -> bool:
        """Called while the component runs; True when it just became stable (its budget is reset)."""
        if self.restart_at is None and now - self.started_at >= self.policy.stable_after_s:
            if self.state is not ComponentState.RUNNING:
                self.state = ComponentState.RUNNING
                self.quick_exits = 0
                return True
        return False

    def exited(self, now: float) -> float:
        """The component exited at `now`: schedules the restart and returns the delay."""
        ran = now - self.started_at
        self.quick_exits = 1 if ran >= self.policy.stable_after_s else self.quick_exits + 1
        delay = min(self.policy.max_backoff_s, self.policy.initial_backoff_s * 2 ** (self.quick_exits - 1))
        if self.quick_exits >= self.policy.failed_after:
            self.state = ComponentState.FAILED
            delay = self.policy.max_backoff_s
        else:
            self.state = ComponentState.BACKOFF
        self.restart_at = now + delay
        return delay

    def due(self, now: float) -> bool:
        """True when a scheduled restart is due."""
        return self.restart_at is not None and now >= self.restart_at
