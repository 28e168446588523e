"""`python -m coordinator --config FILE`: the coordinator process."""

from __future__ import annotations

import argparse
import sys

from coordinator.app import run
from tandem.process import run_component


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem coordinator", description=__doc__)
    parser.add_argument("--config", required=True, help="mesh config file (YAML)")
    args = parser.parse_args(argv)
    return run_component("coordinator", args.config, run)


if __name__ == "__main__":
    sys.exit(main())
