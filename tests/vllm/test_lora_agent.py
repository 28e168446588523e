"""A real CPU vLLM engine with LoRA adapters launched by the node agent through `tandem up`: the mesh file's
`models[].adapters` become vLLM's LoRA flags and runtime loads; a broken adapter is skipped and the engine serves
the base model and the good adapter. Through Envoy, with the OpenAI SDK: the adapters are listed under the base
model, served with their names, and one configured with `preload: false` is loaded into real vLLM by the
coordinator (NodeAgent.LoadAdapter) on its first request."""

from __future__ import annotations

import subprocess

import httpx
import openai
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
        {"name": "late", "path": str(good), "preload": False},  # the same weights under another name
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
        "3",  # room for every configured adapter: good, broken, late
    ]
    url = "http://" + mesh.engine_address("vllm-lora")

    def listed():
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        return [(m["id"], m["parent"]) for m in models]

    assert wait_until(lambda: listed() == [(MODEL_NAME, None), ("good", MODEL_NAME)], 120, "the good adapter")
    assert wait_until(lambda: loaded(mesh) == {"good"}, 30, "the heartbeat lists the good adapter")
    for model in (MODEL_NAME, "good"):
        body = {"model": model, "prompt": "warm up " * 40, "max_tokens": 2}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200 and reply.json()["model"] == model, reply.text


def loaded(mesh) -> set[str]:
    """The adapters the engine's heartbeat lists (Admin/ListInstances), from its `/v1/models`."""
    from tandem.v1 import admin_pb2

    reply = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5)
    return {a for s in reply.instances for a in s.load.loaded_adapters}


@pytest.fixture(scope="module")
def client(mesh):
    with openai.OpenAI(base_url=mesh.http + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_adapters_through_the_mesh_are_listed_served_and_loaded_on_demand(mesh, client):
    models = {m.id: m.model_extra["parent"] for m in client.models.list()}
    assert models == {MODEL_NAME: None, "good": MODEL_NAME, "broken": MODEL_NAME, "late": MODEL_NAME}
    assert wait_until(lambda: loaded(mesh) == {"good"}, 30, "the good adapter loaded")
    for model in ("good", MODEL_NAME):
        reply = client.completions.create(model=model, prompt="Name three rivers. " * 8, max_tokens=4)
        assert reply.model == model and reply.usage.completion_tokens == 4
    loads = mesh.coordinator_metric("tandem_coordinator_adapter_loads_total", outcome="ok")
    chat = client.chat.completions.create(
        model="late", messages=[{"role": "user", "content": "Say hello. " * 8}], max_tokens=4
    )
    assert chat.model == "late" and chat.choices[0].message.content is not None
    assert mesh.coordinator_metric("tandem_coordinator_adapter_loads_total", outcome="ok") == loads + 1
    url = "http://" + mesh.engine_address("vllm-lora")
    served = {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
    # Loaded into the real engine at run time, through vLLM's /v1/load_lora_adapter.
    assert "late" in served, served
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="hello", max_tokens=2)
