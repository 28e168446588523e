"""`python -m simengine [options]`: one simulated vLLM engine. `--help` lists every option."""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from simengine.config import parse_config

    cfg = parse_config(argv)
    try:
        from tandem.logs import setup_logging

        setup_logging("simengine")
    except ImportError:  # pragma: no cover - tandem's runtime is part of the same package
        logging.basicConfig(level=logging.INFO)
    from simengine.api_server import EngineServer

    try:
        server = EngineServer(cfg)
    except (ValueError, OSError) as e:
        print(f"simengine: error: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.run(server.run())
    except OSError as e:
        print(f"simengine: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
