"""Entry points of Tandem processes: logging, uvloop, config errors as one line and exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from tandem.config_file import ConfigError
from tandem.logs import setup_logging

C = TypeVar("C")


def run_component(
    component: str, load: Callable[[], C], main: Callable[[C], Coroutine[Any, Any, None]]
) -> int:
    """Runs `main(load())` on uvloop; a config error (at load or start) exits 2 with one line."""
    setup_logging(component)
    try:
        config = load()
    except ConfigError as exc:
        print(f"tandem {component}: config error: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.run(main(config))
    except ConfigError as exc:
        print(f"tandem {component}: config error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"tandem {component}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
