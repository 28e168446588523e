"""`python -m node_agent --config FILE [--node ID]`: the node agent process."""

from __future__ import annotations

import argparse
import sys

from node_agent.app import run
from tandem.process import run_component


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem agent", description=__doc__)
    parser.add_argument("--config", required=True, help="mesh config file (YAML)")
    parser.add_argument("--node", default=None, help="node_id of this agent (optional when the file has one agent)")
    args = parser.parse_args(argv)
    return run_component("node-agent", args.config, lambda mesh: run(mesh, args.node))


if __name__ == "__main__":
    sys.exit(main())
