"""`python -m conductor --config mesh.yaml`: runs the conductor (the `conductor:` section of the mesh config).

Until `tandem.config.load_mesh_config` exists, a YAML file whose top level has a `conductor:` key (or is the
conductor section itself) is read directly. `--listen` / `--metrics-listen` override the file.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys

import pydantic
import yaml

from conductor.app import SERVICE_NAME, Conductor
from conductor.config import ConductorConfig
from conductor.metrics import register
from tandem.grpc_server import GrpcApp
from tandem.logs import setup_logging

log = logging.getLogger("conductor")


def load_config(path: str | None) -> ConductorConfig:
    """The conductor section of the mesh config at `path` (defaults when no file is given)."""
    if path is None:
        return ConductorConfig()
    try:
        from tandem.config import ConfigError, load_mesh_config  # the mesh loader
    except ImportError:  # pragma: no cover - before tandem.config existed
        load_mesh_config = None
    if load_mesh_config is not None:
        try:
            return load_mesh_config(path).conductor
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping")
    section = raw.get("conductor", raw if "listen" in raw or "direct_endpoints" in raw else {})
    return ConductorConfig.model_validate(section or {})


async def serve(config: ConductorConfig) -> None:
    conductor = Conductor(config)
    app = GrpcApp("conductor", listen=config.listen, metrics_listen=config.metrics_listen)
    app.add_service(SERVICE_NAME, lambda servicer, server: conductor.add_to(server), conductor.service)
    register(conductor.core, conductor.extra_counters)
    app.on_stop(conductor.stop)

    async def after_start() -> None:
        await conductor.start()
        # Everything alive now (modules, grpc, pydantic) is moved out of the collector's reach: a full collection
        # then costs what the index allocated since, not ~10 ms of imports, which would show in Match's p99.
        gc.freeze()

    await app.run(after_start=after_start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conductor", description="Tandem conductor: the KV index")
    ap.add_argument("--config", help="mesh YAML (its conductor: section)")
    ap.add_argument("--listen", help="gRPC address, overrides the config (loopback only)")
    ap.add_argument("--metrics-listen", help="metrics address, overrides the config (loopback only)")
    args = ap.parse_args(argv)
    setup_logging("conductor")
    try:
        config = load_config(args.config)
        overrides = {k: v for k, v in (("listen", args.listen), ("metrics_listen", args.metrics_listen)) if v}
        if overrides:
            config = ConductorConfig.model_validate({**config.model_dump(), **overrides})
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "conductor"
        print(f"conductor: bad configuration: {where}: {first['msg']}", file=sys.stderr)
        return 2
    except (OSError, ValueError, yaml.YAMLError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else repr(exc)
        print(f"conductor: bad configuration: {text}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
