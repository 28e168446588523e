"""Prometheus's view of a mesh: the scrape configuration an operator gives Prometheus to watch what a mesh file
describes (`tandem prometheus-config`), used as is by the observability test against a running mesh.

Every component's `metrics_listen` serves plain HTTP `/metrics` (read-only figures, loopback by default:
docs/security.md); each engine serves vLLM's `/metrics` on its API port. Jobs, one per kind of process:

- `tandem-coordinator` (one target per replica), `tandem-conductor` (per replica), `tandem-agent` (per node): their
  series carry an `instance` label of their own (an engine's instance id), so the jobs keep it (`honor_labels`);
- `tandem-engines`: one target per engine API server, labelled `instance: <instance id>` (the id the coordinator
  and the agents use, `<id>-dp<rank>` for an external-LB DP rank), `model`, `role` and `node`.

Pure: `scrape_config` decides; the command prints it as YAML.
"""

from __future__ import annotations

from typing import Any

from mesh.config import MeshConfig


def _engine_targets(mesh: MeshConfig) -> list[dict[str, Any]]:
    groups = []
    for agent in mesh.node_agents:
        for engine in agent.engines:
            external = engine.data_parallel_mode == "external" and engine.data_parallel_size > 1
            servers = engine.local_dp_size if engine.data_parallel_mode == "external" else 1
            host = f"[{engine.host}]" if ":" in engine.host else engine.host
            for i in range(servers):
                rank = engine.data_parallel_start_rank + i
                instance = f"{engine.instance_id}-dp{rank}" if external else engine.instance_id
                labels = {
                    "instance": instance,
                    "model": engine.model,
                    "role": engine.role,
                    "node": agent.node_id,
                }
                groups.append({"targets": [f"{host}:{engine.port + i}"], "labels": labels})
    return groups


def scrape_config(
    mesh: MeshConfig, scrape_interval: str = "15s", evaluation_interval: str = "15s", rule_files=()
) -> dict[str, Any]:
    """A complete `prometheus.yml` (as a dict) scraping every process of `mesh`; `rule_files` are loaded."""
    # Replicas on hosts of their own (`replica_addresses`) share one metrics_listen: one target each host's.
    coordinators = list(
        dict.fromkeys(
            mesh.coordinator.replica_config(i).metrics_listen for i in range(mesh.coordinator.replicas)
        )
    )
    conductors = list(
        dict.fromkeys(mesh.conductor.replica_config(i).metrics_listen for i in range(mesh.conductor.replicas))
    )
    agents = [{"targets": [a.metrics_listen], "labels": {"node": a.node_id}} for a in mesh.node_agents]
    jobs: list[dict[str, Any]] = [
        {
            "job_name": "tandem-coordinator",
            "honor_labels": True,
            "static_configs": [{"targets": coordinators}],
        },
        {"job_name": "tandem-conductor", "honor_labels": True, "static_configs": [{"targets": conductors}]},
        {"job_name": "tandem-agent", "honor_labels": True, "static_configs": agents},
        {"job_name": "tandem-engines", "static_configs": _engine_targets(mesh)},
    ]
    config: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval},
        "scrape_configs": [
            j for j in jobs if j["static_configs"] and any(g["targets"] for g in j["static_configs"])
        ],
    }
    if rule_files:
        config["rule_files"] = [str(f) for f in rule_files]
    return config
