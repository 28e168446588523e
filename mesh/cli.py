"""The `tandem` command: `tandem up`, the components, and helpers for operators."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.version import __version__

if TYPE_CHECKING:
    from mesh.config import MeshConfig


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
    p_up.add_argument(
        "--certs-dir",
        default=None,
        help="certificates (default: security.certs_dir, else RUN_DIR/certs, created when missing)",
    )
    p_certs = sub.add_parser(
        "certs", help="create the mesh CA and a certificate per component (kept when present)"
    )
    p_certs.add_argument("--config", required=True, help="mesh config file (YAML)")
    p_certs.add_argument("--dir", default=None, help="where (default: security.certs_dir, else ./certs)")
    p_certs.add_argument(
        "--ca-dir",
        default=None,
        help="where the CA's private key is kept (default: DIR-ca beside DIR, mode 0700)",
    )
    p_certs.add_argument("--host", action="append", default=[], help="another name or IP servers answer to")
    p_certs.add_argument(
        "--force", action="store_true", help="re-issue every component certificate from the CA (rotation)"
    )
    p_envoy = sub.add_parser("envoy-config", help="print the Envoy bootstrap generated from a mesh config")
    p_envoy.add_argument("--config", required=True)
    p_envoy.add_argument("--certs-dir", default=None, help="certificates Envoy uses (see `tandem certs`)")
    p_envoy.add_argument(
        "--descriptor",
        default=None,
        help="where Envoy reads the tandem.v1 descriptor set (default: this installation's, from `make protos`)",
    )
    p_prom = sub.add_parser(
        "prometheus-config", help="print a Prometheus configuration scraping every process of a mesh config"
    )
    p_prom.add_argument("--config", required=True, help="mesh config file (YAML)")
    p_prom.add_argument(
        "--rules",
        action="append",
        default=[],
        help="a rule file (or glob) for Prometheus to load; repeatable",
    )
    p_prom.add_argument("--scrape-interval", default="15s", help="scrape and rule evaluation interval")
    p_top = sub.add_parser(
        "top", help="a live view of the mesh (instances, tiers, P/D) from the Admin API, as the operator"
    )
    p_top.add_argument("--config", required=True, help="mesh config file (YAML)")
    p_top.add_argument(
        "--certs-dir", default=None, help="where operator.pem is (default: security.certs_dir)"
    )
    p_top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p_top.add_argument("--once", action="store_true", help="print one frame and exit")
    p_coord = sub.add_parser("coordinator", help="run the coordinator")
    p_coord.add_argument("--config", required=True, help="mesh config file (YAML)")
    p_coord.add_argument(
        "--replica",
        type=int,
        default=None,
        help="run replica I of coordinator.replicas (name c<I>, ports +10*I)",
    )
    p_coord.add_argument("--certs-dir", default=None, help="certificates (default: security.certs_dir)")
    p_coord.add_argument(
        "--standby",
        action="store_true",
        help="a spare (`tandem up` keeps one): import everything, then wait for a line `go` on stdin before "
        "reading the config and serving; exit 0 when stdin ends",
    )
    p_cond = sub.add_parser("conductor", help="run the conductor (the KV index)")
    p_cond.add_argument("--config", default=None, help="mesh config file (YAML); defaults without it")
    p_cond.add_argument("--listen", help="gRPC address, overrides the config")
    p_cond.add_argument("--metrics-listen", help="metrics address, overrides the config")
    p_cond.add_argument(
        "--replica", type=int, default=None, help="run replica I of conductor.replicas (ports +10*I)"
    )
    p_cond.add_argument("--certs-dir", default=None, help="certificates (default: security.certs_dir)")
    p_agent = sub.add_parser(
        "agent",
        help="run a node agent (`tandem agent stop [--engines]` stops one)",
        description="Runs a node agent. `tandem agent stop` asks a running agent to exit; its engines keep serving "
        "for the next agent to adopt unless --engines is given.",
    )
    p_agent.add_argument("action", nargs="?", choices=["run", "stop"], default="run")
    p_agent.add_argument(
        "--engines",
        action="store_true",
        help="with stop: deregister and stop the node's engines too (also when the agent is not running)",
    )
    p_agent.add_argument("--config", required=True, help="mesh config file (YAML)")
    p_agent.add_argument("--certs-dir", default=None, help="certificates (default: security.certs_dir)")
    p_agent.add_argument(
        "--node", default=None, help="node_id of this agent (optional when the file has one)"
    )
    p_agent.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="this node's rank for cross-node engines (env TANDEM_NODE_RANK)",
    )
    p_agent.add_argument(
        "--master-addr",
        default=None,
        help="head node address for cross-node engines (env TANDEM_MASTER_ADDR)",
    )
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
        from mesh.import_vllm import main as import_vllm

        return import_vllm(args.script, args.script_args, args.node_id, args.instance_prefix, args.host)

    from mesh.config import ConfigError, load_mesh_config

    if args.command in ("up", "envoy-config", "certs", "prometheus-config"):
        try:
            mesh = load_mesh_config(args.config)
        except ConfigError as exc:
            print(f"tandem {args.command}: config error: {exc}", file=sys.stderr)
            return 2
        if args.command == "prometheus-config":
            import yaml

            from mesh.observability import scrape_config

            every = args.scrape_interval
            print(yaml.safe_dump(scrape_config(mesh, every, every, args.rules), sort_keys=False), end="")
            return 0
        if args.command == "certs":
            return _certs(mesh, args.dir, args.host, args.force, args.ca_dir)
        if args.command == "envoy-config":
            from mesh.envoy import render_envoy_config
            from mesh.security import certs_dir
            from tandem.protogen import DESCRIPTOR

            try:
                certs = certs_dir(mesh, args.certs_dir or (None if mesh.security.certs_dir else "certs"))
            except ConfigError as exc:
                print(f"tandem envoy-config: config error: {exc}", file=sys.stderr)
                return 2
            descriptor = Path(args.descriptor) if args.descriptor else DESCRIPTOR
            print(render_envoy_config(mesh, descriptor, certs), end="")
            return 0
        from mesh.up import up

        return up(mesh, args.config, Path(args.run_dir).resolve(), args.engine_timeout, args.certs_dir)
    if args.command == "top":
        return _top(args.config, args.certs_dir, args.interval, args.once)
    if args.command == "coordinator":
        return _coordinator(args.config, args.replica, args.certs_dir, args.standby)
    if args.command == "conductor":
        return _conductor(args.config, args.listen, args.metrics_listen, args.replica, args.certs_dir)
    if args.action == "stop":
        return _agent_stop(args.config, args.node, args.engines, args.certs_dir)
    return _agent(args.config, args.node, args.node_rank, args.master_addr, args.certs_dir)


def _certs(
    mesh: MeshConfig, directory: str | None, hosts: list[str], force: bool, ca_dir: str | None = None
) -> int:
    from mesh.certs import CertError, default_ca_dir, describe, ensure_certs
    from mesh.security import certs_dir

    target = Path(directory or "certs").resolve()
    if directory is None and mesh.security.certs_dir and not mesh.security.insecure:
        target = certs_dir(mesh) or target
    ca = Path(ca_dir).resolve() if ca_dir else default_ca_dir(target)
    try:
        written = ensure_certs(target, mesh, force=force, extra_hosts=hosts, ca_dir=ca)
    except CertError as exc:
        print(f"tandem certs: {exc}", file=sys.stderr)
        return 2
    for pem in sorted(target.glob("*.pem")):
        if not pem.name.endswith("-key.pem") and pem.name != "ca-bundle.pem":
            mark = "new " if pem.stem in written else "kept"
            print(f"  {mark} {describe(pem)}")
    print(
        f"tandem certs: {len(written)} certificate(s) written in {target}; the CA's key is in {ca} (keep it there)"
    )
    return 0


def _agent_stop(path: str, node: str | None, engines: bool, certs: str | None) -> int:
    from mesh.config import ConfigError, load_mesh_config
    from mesh.security import component_tls
    from node_agent.shutdown import shutdown_agent

    try:
        mesh = load_mesh_config(path)
        config = mesh.node_agent(node)
        tls = component_tls(mesh, "operator", certs)
    except ConfigError as exc:
        print(f"tandem agent stop: config error: {exc}", file=sys.stderr)
        return 2
    report = shutdown_agent(config, stop_engines=engines, tls=tls)
    print(report.summary(config.node_id))
    return 0 if not report.agent_answered or report.agent_exited else 1


def _top(path: str, certs: str | None, interval: float, once: bool) -> int:
    from mesh.config import ConfigError, load_mesh_config
    from mesh.security import component_tls
    from mesh.top import run
    from tandem import tls

    try:
        mesh = load_mesh_config(path)
        files = component_tls(mesh, "operator", certs)
    except ConfigError as exc:
        print(f"tandem top: config error: {exc}", file=sys.stderr)
        return 2
    address = mesh.control_address
    with tls.channel(address, files, "envoy") as channel:
        return run(channel, address, interval, once)


def _coordinator(path: str, replica: int | None, certs: str | None, standby: bool = False) -> int:
    from coordinator.app import run
    from mesh.config import ConfigError, load_mesh_config
    from mesh.security import component_tls
    from tandem.process import run_component, wait_for_go

    def load(file: str | Path) -> MeshConfig:
        mesh = load_mesh_config(file)
        if replica is None:
            return mesh
        try:
            section = mesh.coordinator.replica_config(replica)
        except ValueError as exc:
            raise ConfigError(f"{file}: coordinator.replicas: {exc}") from None
        return mesh.model_copy(update={"coordinator": section})

    def main(mesh: MeshConfig) -> Coroutine[Any, Any, None]:
        return _traced(mesh, "tandem-coordinator", run(mesh, load, component_tls(mesh, "coordinator", certs)))

    return run_component("coordinator", lambda: load(path), main, wait_for_go if standby else None)


def _conductor(
    path: str | None, listen: str | None, metrics_listen: str | None, replica: int | None, certs: str | None
) -> int:
    from conductor.app import run
    from conductor.config import ConductorConfig
    from mesh.config import ConfigError, load_mesh_config, parse_mesh_config
    from mesh.security import component_tls
    from tandem.config_file import validate
    from tandem.process import run_component
    from tandem.tls import TlsFiles

    def load() -> tuple[ConductorConfig, TlsFiles | None, dict[str, frozenset[str]], MeshConfig]:
        mesh = load_mesh_config(path) if path else parse_mesh_config({}, "<defaults>")
        tls = component_tls(mesh, "conductor", certs)
        config = mesh.conductor
        if replica is not None:
            try:
                config = config.replica_config(replica)
            except ValueError as exc:
                raise ConfigError(f"{path}: conductor.replicas: {exc}") from None
        overrides = {k: v for k, v in (("listen", listen), ("metrics_listen", metrics_listen)) if v}
        if overrides:
            config = validate(ConductorConfig, {**config.model_dump(), **overrides}, "command line")
        # who may send KV events for which instance
        return config, tls, dict(mesh.node_book.owners), mesh

    return run_component(
        "conductor", load, lambda loaded: _traced(loaded[3], "tandem-conductor", run(*loaded[:3]))
    )


def _agent(
    path: str, node: str | None, node_rank: int | None, master_addr: str | None, certs: str | None
) -> int:
    from mesh.config import load_mesh_config
    from mesh.security import component_tls, engine_tls_env
    from node_agent.app import run
    from node_agent.launch import LaunchError, Placement
    from tandem.process import run_component
    from tandem.tracing_config import engine_env as tracing_env

    try:
        env = Placement.from_env()
    except LaunchError as exc:
        print(f"tandem agent: {exc}", file=sys.stderr)
        return 2
    placement = Placement(
        node_rank if node_rank is not None else env.node_rank, master_addr or env.master_addr
    )

    def main(mesh: MeshConfig) -> Coroutine[Any, Any, None]:
        config = mesh.node_agent(node)
        coordinator = config.coordinator_address or mesh.registry_address
        conductor = (
            [config.conductor_address] if config.conductor_address else mesh.conductor.replica_endpoints
        )
        tls = component_tls(mesh, f"agent/{config.node_id}", certs)
        # Engines get a copy of the CA bundle in the runtime directory, not the certificate directory's path.
        engine_env = engine_tls_env(mesh, certs, into=Path(config.runtime_path))
        engine_env.update(tracing_env(mesh.tracing))
        return _traced(
            mesh, "tandem-agent", run(config, coordinator, conductor, mesh.path, placement, tls, engine_env)
        )

    return run_component("node-agent", lambda: load_mesh_config(path), main)


async def _traced(mesh: MeshConfig, service_name: str, main: Coroutine[Any, Any, None]) -> None:
    """Runs a component's `main` with this process's tracer (`tracing` in the mesh file; nothing when off),
    flushing its last spans as it ends."""
    from tandem import tracing

    tracing.setup(mesh.tracing, service_name)
    try:
        await main
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    sys.exit(main())
