"""Shared by benchmarks and end-to-end tests: free loopback ports and mesh configs for simulated fleets."""

from __future__ import annotations

import socket
import tempfile


def free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def mesh_config(
    engines: int = 2,
    engine_args: list[str] | None = None,
    policy: str = "least_load",
    model: str = "tandem-sim",
    heartbeat_interval_s: float = 0.5,
) -> dict:
    """A one-node mesh of simulated engines on free ports, as a dict ready for YAML.

    The node agent gets its own runtime directory: the default, `/tmp/tandem-<node_id>`, holds the engines' KV
    event IPC sockets and would be shared by every mesh on the machine with the same node id (meshes started one
    after another in one benchmark, or by tests running at the same time)."""
    ports = free_ports(10 + engines)
    addr = [f"127.0.0.1:{p}" for p in ports]
    return {
        "envoy": {
            "http_listen": addr[0],
            "grpc_listen": addr[1],
            "admin_listen": addr[2],
            "callback_listen": f"127.0.0.1:{ports[9 + engines]}",
            "base_id": ports[0],
        },
        "coordinator": {
            "listen": addr[3],
            "metrics_listen": addr[4],
            "heartbeat_interval_s": heartbeat_interval_s,
            "scheduler": {"policy": policy},
        },
        "conductor": {"listen": addr[5], "metrics_listen": addr[6]},
        "models": [{"name": model}],
        "node_agents": [
            {
                "node_id": "n1",
                "runtime_dir": tempfile.mkdtemp(prefix="tandem-n1-"),
                "listen": addr[7],
                "metrics_listen": addr[8],
                "probe_interval_s": 0.5,
                "restart": {"initial_backoff_s": 0.2, "max_backoff_s": 1.0},
                "engines": [
                    {
                        "instance_id": f"sim-{i}",
                        "model": model,
                        "port": ports[9 + i],
                        "args": list(engine_args or []),
                    }
                    for i in range(engines)
                ],
            }
        ],
    }
