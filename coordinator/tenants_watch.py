"""The tenants the coordinator serves: the mesh file's `coordinator.tenants` plus the reloadable
`coordinator.tenants_file`, read again whenever the file's content changes (its hash, as `config_watch.py` does).

A file that is malformed (not YAML, a bad entry, a name or key used twice) is one line in the log, and the tenants
last read from it stay in force; at start-up it is a ConfigError (the coordinator does not start on a bad file).
The quota state of a tenant that stays (same name) is kept across a reload; only its limits change.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from coordinator.tenants import TenantSpec, TenantTable, check_unique, parse_tenants_file
from tandem.config_file import ConfigError

log = logging.getLogger(__name__)


def load_tenants(inline: Sequence[TenantSpec], path: str | None) -> TenantTable:
    """The mesh file's tenants and those of `path`; ConfigError (one line) for an unreadable or bad file."""
    specs = list(inline)
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"coordinator.tenants_file: cannot read {path!r}: {exc.strerror}") from None
        specs += parse_tenants_file(text)
    return TenantTable(check_unique(specs, "coordinator.tenants_file"))


class TenantsWatch:
    """Applies the tenants file each time its content changes (`poll`); `apply` gets the new table."""

    def __init__(
        self, inline: Sequence[TenantSpec], path: str, apply: Callable[[TenantTable], object]
    ) -> None:
        self.inline = list(inline)
        self.path = path
        self.apply = apply
        self._digest: bytes | None = None
        self.errors = 0  # reloads refused (malformed file)

    def poll(self) -> bool:
        """Reads the file; True when a new table was applied."""
        try:
            data = Path(self.path).read_bytes()
        except OSError as exc:
            data = f"unreadable: {exc.strerror}".encode()
        digest = hashlib.sha256(data).digest()
        if digest == self._digest:
            return False
        first = self._digest is None
        self._digest = digest
        try:
            table = load_tenants(self.inline, self.path)
        except ConfigError as exc:
            self.errors += 1
            log.error("tenants file rejected, keeping the tenants last read: %s", exc)
            return False
        if not first:
            log.info("tenants reloaded", extra={"tenants": len(table)})
        self.apply(table)
        return True


async def watch_tenants(watch: TenantsWatch, interval_s: float = 1.0) -> None:
    """Polls the file every `interval_s`; see `TenantsWatch.poll`."""
    while True:
        await asyncio.sleep(interval_s)
        watch.poll()
