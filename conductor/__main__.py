"""`python -m conductor --config mesh.yaml`: runs the conductor (the `conductor:` section of the mesh config).

`--listen` / `--metrics-listen` override the file.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys

import pydantic
import uvloop

from conductor.app import SERVICE_NAME, Conductor
from conductor.config import ConductorConfig
from conductor.metrics import register
from tandem.config import ConfigError, load_mesh_config, parse_mesh_config
from tandem.grpc_server import GrpcApp
from tandem.logs import setup_logging

log = logging.getLogger("conductor")


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
    ap.add_argument("--config", help="mesh YAML (its conductor: section); defaults without it")
    ap.add_argument("--listen", help="gRPC address, overrides the config (loopback only)")
    ap.add_argument("--metrics-listen", help="metrics address, overrides the config (loopback only)")
    args = ap.parse_args(argv)
    setup_logging("conductor")
    try:
        mesh = load_mesh_config(args.config) if args.config else parse_mesh_config({}, "<defaults>")
        config = mesh.conductor
        overrides = {k: v for k, v in (("listen", args.listen), ("metrics_listen", args.metrics_listen)) if v}
        if overrides:
            config = ConductorConfig.model_validate({**config.model_dump(), **overrides})
    except ConfigError as exc:
        print(f"tandem conductor: config error: {exc}", file=sys.stderr)
        return 2
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        print(f"tandem conductor: config error: --{first['loc'][0]}: {first['msg']}", file=sys.stderr)
        return 2
    uvloop.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
