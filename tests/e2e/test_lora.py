"""LoRA adapters through `tandem up` with examples/lora.yaml's models, adapters, engines and policy (on free ports):
the OpenAI SDK calls two adapters and the base model and gets answers echoing them; each adapter's requests land
on the engine holding it; `/v1/models` lists the adapters under their base model; an adapter no engine loaded at
start (`preload: false`) is loaded by the coordinator onto one engine and served there; past an engine's slots its
least recently used idle adapter is unloaded and every adapter stays servable; an unknown name is vLLM's
404; an adapter whose path holds nothing gets a clear error while the engines keep serving the others. Every test
sends a handful of requests, each bounded by the SDK's timeout and no retries."""

from __future__ import annotations

import copy

import httpx
import openai
import pytest
import yaml

from mesh.config import adapter_path_from
from tandem.v1 import admin_pb2
from tests.helpers import ROOT, RunningMesh, mesh_config, wait_until

EXAMPLE_FILE = ROOT / "examples" / "lora.yaml"
EXAMPLE = yaml.safe_load(EXAMPLE_FILE.read_text())
MODEL = EXAMPLE["models"][0]["name"]


def absolute(adapters: list[dict]) -> list[dict]:
    """The example's adapters with their `./` paths taken from the example's directory (the test's mesh file lives
    elsewhere)."""
    return [{**a, "path": adapter_path_from(EXAMPLE_FILE.parent, a["path"])} for a in adapters]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    config = mesh_config(engines=2, engine_args=["--speedup", "20"], model=MODEL)
    config["coordinator"]["scheduler"] = copy.deepcopy(EXAMPLE["coordinator"]["scheduler"])
    config["coordinator"]["adapters"] = dict(EXAMPLE["coordinator"]["adapters"])
    model = copy.deepcopy(EXAMPLE["models"][0])
    # More adapters, not in the example, none preloaded: two to fill the engines' slots, and one with nothing at its
    # path.
    spare = adapter_path_from(EXAMPLE_FILE.parent, "./adapters/summarize")
    model["adapters"] = absolute(model["adapters"]) + [
        {"name": "extra-1", "path": spare, "preload": False},
        {"name": "extra-2", "path": spare, "preload": False},
        {"name": "broken", "path": "/nonexistent/tandem-adapter", "preload": False},
    ]
    config["models"] = [model]
    for engine, example in zip(
        config["node_agents"][0]["engines"], EXAMPLE["node_agents"][0]["engines"], strict=True
    ):
        engine["instance_id"] = example["instance_id"]
        engine["adapters"] = absolute(example["adapters"])
    running = RunningMesh(config, tmp_path_factory.mktemp("lora"))
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(mesh):
    with openai.OpenAI(base_url=mesh.http + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def loaded(mesh) -> dict[str, set[str]]:
    """Per instance, the adapters its heartbeat lists (Admin/ListInstances)."""
    reply = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5)
    return {s.instance.instance_id: set(s.load.loaded_adapters) for s in reply.instances}


def routed(mesh) -> dict[str, float]:
    return {
        iid: mesh.coordinator_metric("tandem_coordinator_routed_requests_total", instance=iid)
        for iid in ("sim-0", "sim-1")
    }


def served_on(mesh, client, model: str) -> str:
    """The instance a completion for `model` was routed to (requests are sent one at a time)."""
    before = routed(mesh)
    reply = client.completions.create(model=model, prompt="Write a query for the top customers", max_tokens=4)
    assert reply.model == model
    after = routed(mesh)
    (instance,) = [iid for iid in after if after[iid] > before[iid]]
    return instance


def test_the_example_is_a_valid_mesh_file():
    from mesh.config import load_mesh_config

    config = load_mesh_config(EXAMPLE_FILE)
    names = {a.name: a for a in config.models[0].adapters}
    assert set(names) == {"sql", "chat", "summarize"} and not names["summarize"].preload
    assert all(a.path.startswith(str(EXAMPLE_FILE.parent)) for a in names.values())
    assert config.coordinator.scheduler.policy == "lora_affinity" and not config.coordinator.api_keys_file


def test_adapters_and_the_base_model_are_served_with_their_names_where_they_are_loaded(mesh, client):
    wait_until(
        lambda: loaded(mesh) == {"sim-0": {"sql"}, "sim-1": {"chat"}}, 30, "adapters preloaded", interval=0.2
    )
    for _ in range(3):
        assert served_on(mesh, client, "sql") == "sim-0"
        assert served_on(mesh, client, "chat") == "sim-1"
    chat = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert chat.model == "chat" and chat.choices[0].message.content is not None
    assert served_on(mesh, client, MODEL) in {"sim-0", "sim-1"}


def test_v1_models_lists_every_configured_adapter_under_its_base_model(mesh, client):
    models = {m.id: m for m in client.models.list()}
    adapters = {"sql", "chat", "summarize", "extra-1", "extra-2", "broken"}
    assert set(models) == {MODEL} | adapters
    assert models[MODEL].model_extra["parent"] is None
    assert all(models[a].model_extra["parent"] == MODEL for a in adapters)


def test_an_adapter_not_loaded_anywhere_is_loaded_on_one_engine_and_served_there(mesh, client):
    assert all("summarize" not in names for names in loaded(mesh).values())
    loads = mesh.coordinator_metric("tandem_coordinator_adapter_loads_total", outcome="ok")
    first = served_on(mesh, client, "summarize")
    assert mesh.coordinator_metric("tandem_coordinator_adapter_loads_total", outcome="ok") == loads + 1
    wait_until(
        lambda: "summarize" in loaded(mesh)[first], 10, "the heartbeat lists the loaded adapter", interval=0.2
    )
    assert all("summarize" not in names for iid, names in loaded(mesh).items() if iid != first)
    for _ in range(3):
        assert served_on(mesh, client, "summarize") == first
    assert mesh.coordinator_metric("tandem_coordinator_adapter_loads_total", outcome="ok") == loads + 1


def test_past_its_slots_an_engine_unloads_its_least_recently_used_idle_adapter_and_all_stay_servable(
    mesh, client
):
    slots = EXAMPLE["models"][0]["max_loras"]
    assert (
        slots == 2 and mesh.coordinator_metric("tandem_coordinator_adapter_unloads_total", outcome="ok") == 0
    )
    served_on(mesh, client, "extra-1")  # the engine with a free slot takes it: now both are full
    wait_until(
        lambda: all(len(names) == slots for names in loaded(mesh).values()),
        10,
        "both engines full",
        interval=0.2,
    )
    assert mesh.coordinator_metric("tandem_coordinator_adapter_unloads_total", outcome="ok") == 0
    full = served_on(
        mesh, client, "extra-2"
    )  # loaded on a full engine: its least recently used idle adapter goes
    wait_until(
        lambda: mesh.coordinator_metric("tandem_coordinator_adapter_unloads_total", outcome="ok") == 1,
        10,
        "one unload",
        interval=0.2,
    )
    wait_until(
        lambda: "extra-2" in loaded(mesh)[full] and len(loaded(mesh)[full]) == slots,
        10,
        "the unload listed",
        interval=0.2,
    )
    for adapter in (
        "sql",
        "chat",
        "summarize",
        "extra-1",
        "extra-2",
    ):  # each served, loaded again where needed
        served_on(mesh, client, adapter)
    wait_until(
        lambda: all(len(names) <= slots for names in loaded(mesh).values()),
        10,
        "within the slots",
        interval=0.2,
    )


def test_an_unknown_adapter_is_vllms_404(mesh, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2)
    error = info.value.response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("NotFoundError", "model", 404)
    assert "`no-such-adapter` does not exist" in error["message"] and "sql" in error["message"]


def test_a_broken_adapter_gets_a_clear_error_and_the_engines_keep_serving_the_others(mesh, client):
    reply = httpx.post(
        mesh.http + "/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert reply.status_code == 500, reply.text
    error = reply.json()["error"]
    assert error["type"] == "InternalServerError"
    assert (
        "`broken` could not be loaded" in error["message"]
        and "/nonexistent/tandem-adapter" in error["message"]
    )
    # The other engine is tried for the next request; then both are held back and the answer says so at once.
    second = httpx.post(
        mesh.http + "/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert second.status_code == 500
    third = httpx.post(
        mesh.http + "/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert (
        third.status_code == 500 and "could not be loaded on any instance" in third.json()["error"]["message"]
    )
    assert mesh.coordinator_metric("tandem_coordinator_adapter_loads_total", outcome="failed") == 2
    assert served_on(mesh, client, "sql") in {"sim-0", "sim-1"} and served_on(mesh, client, "chat")
    assert all("broken" not in names for names in loaded(mesh).values())
    assert mesh.coordinator_metric("tandem_coordinator_adapter_unloads_total", outcome="failed") == 0
