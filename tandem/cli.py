"""The `tandem` command: `tandem up`, the components, and helpers for operators."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.version import __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: a gRPC-first service mesh for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="run the whole mesh on this machine (Ctrl-C stops it)")
    p_up.add_argument("--config", required=True, help="mesh config file (YAML)")
    p_up.add_argument("--run-dir", default="run", help="where logs and generated files go (default ./run)")
    p_up.add_argument(
        "--engine-timeout", type=float, default=120.0, help="seconds to wait for engines at start"
    )
    p_envoy = sub.add_parser("envoy-config", help="print the Envoy bootstrap generated from a mesh config")
    p_envoy.add_argument("--config", required=True)
    for name, help_text in (("coordinator", "run the coordinator"), ("conductor", "run the conductor")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--config", required=True)
    p_agent = sub.add_parser("agent", help="run a node agent")
    p_agent.add_argument("--config", required=True)
    p_agent.add_argument("--node", default=None)
    p_import = sub.add_parser(
        "import-vllm", help="print agent config (YAML) for a `vllm serve` launch script"
    )
    p_import.add_argument("script", help="a shell script that runs `vllm serve`")
    p_import.add_argument(
        "script_args", nargs="*", help="values of the script's $1, $2, ... (launcher templates)"
    )
    p_import.add_argument("--node-id", default="node-1", help="node_id of the generated node_agents entry")
    p_import.add_argument(
        "--instance-prefix", default=None, help="instance ids are PREFIX-0, ... (default: role)"
    )
    p_import.add_argument(
        "--host", default=None, help="address engines are reached at (default: from the script)"
    )
    args = parser.parse_args(argv)
    if args.command == "import-vllm":
        from tandem.import_vllm import main as import_vllm

        return import_vllm(args.script, args.script_args, args.node_id, args.instance_prefix, args.host)

    from tandem.config import ConfigError, load_mesh_config

    if args.command in ("up", "envoy-config"):
        try:
            mesh = load_mesh_config(args.config)
        except ConfigError as exc:
            print(f"tandem {args.command}: config error: {exc}", file=sys.stderr)
            return 2
        if args.command == "envoy-config":
            import yaml

            from tandem.envoy_config import build_envoy_config
            from tandem.protogen import DESCRIPTOR

            print(yaml.safe_dump(build_envoy_config(mesh, DESCRIPTOR), sort_keys=False))
            return 0
        from tandem.up import up

        return up(mesh, args.config, Path(args.run_dir).resolve(), args.engine_timeout)
    if args.command == "coordinator":
        from coordinator.__main__ import main as run

        return run(["--config", args.config])
    if args.command == "conductor":
        from conductor.__main__ import main as run

        return run(["--config", args.config])
    from node_agent.__main__ import main as run

    return run(["--config", args.config, *(["--node", args.node] if args.node else [])])


if __name__ == "__main__":
    sys.exit(main())
