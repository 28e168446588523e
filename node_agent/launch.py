"""Engine launch commands as argument lists and environments (never shell strings)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from node_agent.config import EngineConfig


@dataclass(frozen=True, slots=True)
class KvEventEndpoints:
    """Where an engine publishes its KV events (PUB) and answers replays (ROUTER); the engine binds both."""

    endpoint: str
    replay_endpoint: str


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What to execute for one engine."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the agent's own environment
    kv_events: KvEventEndpoints | None = None


def kv_event_endpoints(engine: EngineConfig, runtime_dir: str) -> KvEventEndpoints:
    """IPC endpoints in the runtime dir: local to the node, so nothing binds a network address."""
    base = os.path.join(runtime_dir, f"{engine.instance_id}-kv")
    return KvEventEndpoints(f"ipc://{base}.sock", f"ipc://{base}-replay.sock")


def _program(engine: EngineConfig) -> list[str]:
    if engine.backend == "simengine":
        return [sys.executable, "-m", "simengine", "--model", engine.model]
    if engine.backend == "vllm":
        # The CPU wheel's `vllm serve` trips on its package name; the API server module is the same server.
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(engine.model_path)]
    return ["vllm", "serve", str(engine.model_path)]


def build_launch(engine: EngineConfig, runtime_dir: str) -> LaunchSpec:
    """The command line of an engine, with the flags vLLM and simengine share."""
    argv = _program(engine)
    argv += ["--host", engine.host, "--port", str(engine.port), "--served-model-name", engine.model]
    argv += ["--block-size", str(engine.block_size)]
    if engine.tokenizer and engine.backend == "simengine":
        argv += ["--tokenizer", engine.tokenizer]
    endpoints = None
    if engine.kv_events:
        endpoints = kv_event_endpoints(engine, runtime_dir)
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoints.endpoint,
            "replay_endpoint": endpoints.replay_endpoint,
            "topic": "kv-events",
        }
        argv += ["--kv-events-config", json.dumps(events, separators=(",", ":"))]
    argv += engine.args
    return LaunchSpec(argv=argv, env=dict(engine.env), kv_events=endpoints)
