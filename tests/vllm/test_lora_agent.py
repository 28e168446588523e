"""A real CPU vLLM engine with LoRA adapters launched by the node agent through `tandem up`: the mesh file's
`models[].adapters` become vLLM's LoRA flags and runtime loads; a broken adapter is skipped and the engine serves
the base model and the good adapter."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from tests.helpers import wait_until
from tests.vllm.conformance import ROOT
from tests.vllm.conftest import MODEL, MODEL_NAME, VLLM_PYTHON, real_mesh, start


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lora-agent")
    good = workdir / "lora-good"
    subprocess.run([VLLM_PYTHON, str(ROOT / "scripts/build_tiny_lora.py"), MODEL, str(good), "8"], check=True,
                   timeout=120)  # fmt: skip
    config = real_mesh([("vllm-lora", "hybrid", None)], workdir)
    config["models"][0]["adapters"] = [
        {"name": "good", "path": str(good)},
        {"name": "broken", "path": str(workdir / "no-such-adapter")},
    ]
    running = start(config, workdir)
    yield running
    assert running.stop() == 0


def test_configured_adapters_loaded_into_real_vllm(mesh):
    status = mesh.engines()["vllm-lora"]
    argv = list(status.argv)
    at = argv.index("--enable-lora")
    assert argv[at : at + 7] == [
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-lora-rank",
        "16",
        "--max-cpu-loras",
        "2",
    ]
    url = "http://" + mesh.engine_address("vllm-lora")

    def listed():
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        return [(m["id"], m["parent"]) for m in models]

    assert wait_until(lambda: listed() == [(MODEL_NAME, None), ("good", MODEL_NAME)], 120, "the good adapter")
    for model in (MODEL_NAME, "good"):
        body = {"model": model, "prompt": "warm up " * 40, "max_tokens": 2}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["model"] == model, reply.text
