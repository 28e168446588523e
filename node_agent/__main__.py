"""`python -m node_agent --config FILE [--node ID] [--node-rank N] [--master-addr ADDR]`: the node agent process."""

from __future__ import annotations

import argparse
import sys

from node_agent.app import run
from node_agent.launch import LaunchError, Placement
from tandem.process import run_component


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem agent", description=__doc__)
    parser.add_argument("--config", required=True, help="mesh config file (YAML)")
    parser.add_argument(
        "--node", default=None, help="node_id of this agent (optional when the file has one agent)"
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this node's rank for cross-node engines (env TANDEM_NODE_RANK)",
    )
    parser.add_argument(
        "--master-addr",
        default=None,
        help="head node address for cross-node engines (env TANDEM_MASTER_ADDR)",
    )
    args = parser.parse_args(argv)
    try:
        env = Placement.from_env()
    except LaunchError as exc:
        print(f"tandem agent: {exc}", file=sys.stderr)
        return 2
    placement = Placement(
        args.node_rank if args.node_rank is not None else env.node_rank, args.master_addr or env.master_addr
    )
    return run_component("node-agent", args.config, lambda mesh: run(mesh, args.node, placement))


if __name__ == "__main__":
    sys.exit(main())
