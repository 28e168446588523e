"""Reloads the `coordinator.scheduler` section when the mesh file changes; other sections need a restart.

A change is a change of the file's content (its hash), not of its modification time: an editor or `cp` that
truncates and rewrites the file within one mtime tick is still seen. A file caught empty, unreadable or half
written (not YAML, or an empty document) is skipped with a warning and the running scheduler kept; it is read
again as soon as its content changes. The layer that composes the mesh file passes `load` (path -> config), so
this module imports neither that layer nor the other components.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import yaml

from coordinator.config import MeshView
from coordinator.kv_match import ConductorMatcher
from coordinator.picker import EndpointPicker
from tandem.config_file import ConfigError

log = logging.getLogger(__name__)


def apply_scheduler_change(running: MeshView, fresh: MeshView, picker: EndpointPicker, matcher) -> bool:
    """Switches to `fresh`'s scheduler when it differs; True when it did."""
    old, new = running.coordinator.scheduler, fresh.coordinator.scheduler
    if old.model_dump() == new.model_dump():
        return False
    picker.policy, picker.decode_policy = new.build(), new.build_decode()
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


def _read(path: str) -> tuple[bytes, str]:
    """The file's bytes and what is wrong when they are empty ("empty", or why it could not be read)."""
    try:
        return Path(path).read_bytes(), "empty"
    except OSError as exc:
        return b"", f"cannot read: {exc.strerror}"


class ConfigWatch:
    """Applies the mesh file's scheduler section each time the file's content changes (`poll`)."""

    def __init__(
        self,
        running: MeshView,
        load: Callable[[str], MeshView],
        picker: EndpointPicker,
        matcher: ConductorMatcher | None,
    ) -> None:
        self.running = running
        self.load = load
        self.picker = picker
        self.matcher = matcher
        self._digest: bytes | None = None  # of the content last read; None before the first poll

    def poll(self) -> bool:
        """Reads the file; True when its scheduler section was applied. The first poll reads the file too (a
        change since start-up is applied; an unchanged file changes nothing)."""
        path = self.running.path
        text, problem = _read(path)
        digest = hashlib.sha256(text).digest()
        if digest == self._digest:
            return False
        self._digest = digest
        try:
            data = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as exc:
            data, problem = None, f"not YAML: {getattr(exc, 'problem', None) or exc}"
        if data is None:
            log.warning(
                "config file unreadable or empty, keeping the running scheduler",
                extra={"path": path, "problem": problem},
            )
            return False
        try:
            fresh = self.load(path)
        except ConfigError as exc:
            log.error("config reload failed, keeping the running scheduler", extra={"error": str(exc)})
            return False
        if hashlib.sha256(_read(path)[0]).digest() != digest:
            return False  # rewritten while `load` read it: what it read is unchecked; the next poll reads it again
        return apply_scheduler_change(self.running, fresh, self.picker, self.matcher)


async def watch_config(
    running: MeshView,
    load: Callable[[str], MeshView],
    picker: EndpointPicker,
    matcher: ConductorMatcher | None,
    interval_s: float = 1.0,
) -> None:
    """Polls the file every `interval_s`; see `ConfigWatch.poll`."""
    watch = ConfigWatch(running, load, picker, matcher)
    while True:
        await asyncio.sleep(interval_s)
        watch.poll()
