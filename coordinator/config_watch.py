"""Reloads the `coordinator.scheduler` section when the mesh file changes; other sections need a restart."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from coordinator.config import MeshView
from coordinator.kv_match import ConductorMatcher
from coordinator.picker import EndpointPicker
from tandem.config_file import ConfigError

log = logging.getLogger(__name__)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def apply_scheduler_change(running: MeshView, fresh: MeshView, picker: EndpointPicker, matcher) -> bool:
    """Switches to `fresh`'s scheduler when it differs; True when it did."""
    old, new = running.coordinator.scheduler, fresh.coordinator.scheduler
    if old.model_dump() == new.model_dump():
        return False
    picker.policy = new.build()
    running.coordinator.scheduler = new
    if matcher is not None:
        matcher.timeout_s = new.match_timeout_ms / 1000
    rest_changed = fresh.model_dump(exclude={"coordinator": {"scheduler"}}) != running.model_dump(
        exclude={"coordinator": {"scheduler"}}
    )
    log.info("scheduler reloaded", extra={"policy": new.policy, "other_sections_changed": rest_changed})
    if rest_changed:
        log.warning("only coordinator.scheduler reloads; restart the mesh for the other changes")
    return True


async def watch_config(
    running: MeshView,
    load: Callable[[str], MeshView],
    picker: EndpointPicker,
    matcher: ConductorMatcher | None,
    interval_s: float = 1.0,
) -> None:
    """Polls the file's modification time; a bad new file is logged and the running scheduler kept."""
    last = _mtime(running.path)
    while True:
        await asyncio.sleep(interval_s)
        now = _mtime(running.path)
        if now == last:
            continue
        last = now
        try:
            fresh = load(running.path)
        except ConfigError as exc:
            log.error("config reload failed, keeping the running scheduler", extra={"error": str(exc)})
            continue
        apply_scheduler_change(running, fresh, picker, matcher)
