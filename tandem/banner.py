"""The startup banner every Tandem process prints: version and role, one line when `TANDEM_NO_BANNER=1`."""

from __future__ import annotations

import os
import sys

from tandem.version import __version__

_ART = r"""
  _                    _
 | |_ __ _ _ __   __| | ___ _ __ ___
 | __/ _` | '_ \ / _` |/ _ \ '_ ` _ \
 | || (_| | | | | (_| |  __/ | | | | |
  \__\__,_|_| |_|\__,_|\___|_| |_| |_|
"""


def banner_text(role: str, details: dict[str, str] | None = None) -> str:
    """The banner for a component `role` with optional `key: value` details (listen addresses...)."""
    line = f"tandem {__version__} {role}"
    if details:
        line += " " + " ".join(f"{k}={v}" for k, v in details.items())
    if os.environ.get("TANDEM_NO_BANNER") == "1":
        return line
    rows = [f"  {k:<10} {v}" for k, v in (details or {}).items()]
    return "\n".join([_ART.rstrip("\n"), f"  version    {__version__}", f"  role       {role}", *rows, ""])


def print_banner(role: str, details: dict[str, str] | None = None) -> None:
    """Writes the banner to stderr, so that stdout stays free for data."""
    print(banner_text(role, details), file=sys.stderr, flush=True)
