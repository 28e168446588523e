"""Entry points of Tandem processes: logging, uvloop, config errors as one line and exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

from tandem.config import ConfigError, MeshConfig, load_mesh_config
from tandem.logs import setup_logging


def run_component(component: str, config_path: str, main: Callable[[MeshConfig], Awaitable[None]]) -> int:
    """Loads the mesh config and runs `main(config)` on uvloop; a config error exits 2 with one line."""
    setup_logging(component)
    try:
        config = load_mesh_config(config_path)
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
