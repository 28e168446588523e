"""Entry points of Tandem processes: logging, uvloop, config errors as one line and exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable, Coroutine
from typing import IO, Any, TypeVar

from tandem.config_file import ConfigError
from tandem.logs import setup_logging

C = TypeVar("C")


def wait_for_go(stream: IO[str] | None = None) -> bool:
    """A spare's gate: blocks until a line arrives on `stream` (stdin); True for `go`, False when the stream ends
    (its supervisor stopped it, or died)."""
    line = (stream or sys.stdin).readline()
    return line.strip() == "go"


def run_component(
    component: str,
    load: Callable[[], C],
    main: Callable[[C], Coroutine[Any, Any, None]],
    gate: Callable[[], bool] | None = None,
) -> int:
    """Runs `main(load())` on uvloop; a config error (at load or start) exits 2 with one line. With a `gate` (a
    spare: its modules already imported) nothing is read before the gate opens; a gate that does not open exits 0.
    """
    import uvloop

    setup_logging(component)
    if gate is not None and not gate():
        return 0
    try:
        config = load()
    except ConfigError as exc:
        print(f"tandem {component}: config error: {exc}", file=sys.stderr)
        return 2
    try:
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
