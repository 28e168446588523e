"""The joint (prefill, decode) choice through the real mesh (issue 21): examples/pd-handoff.yaml and
pd-trigger.yaml as shipped, two node agents on loopback addresses (n1 on 127.0.0.1, n2 on 127.0.0.2) with a simulated
prefill and decode engine each, on free ports. The same reuse-heavy requests go through each once with `pd_choice:
separate` (least-load decode) and once with `joint`: the joint choice moves fewer KV bytes across nodes (as the
engines count them, `simengine:kv_transfer_peer_bytes_total` by peer host, and as the coordinator predicts them) and
every request is answered, as the aggregated engine answers at temperature 0. A decode instance whose KV cache is
full is never chosen."""

from __future__ import annotations

import concurrent.futures
import copy
import re
import tempfile

import httpx
import pytest
import yaml

from tandem.v1 import admin_pb2, common_pb2
from tests.helpers import ROOT, RunningMesh, free_ports, metric_sum

EXAMPLES = {
    name: yaml.safe_load((ROOT / "examples" / name).read_text())
    for name in ("pd-handoff.yaml", "pd-trigger.yaml")
}
PEER_BYTES = "simengine:kv_transfer_peer_bytes_total"
COORDINATOR_BYTES = "tandem_coordinator_kv_transfer_bytes_total"

#: A reuse-heavy set (bounded: 48 requests): 4 documents of about 730 tokens (the built-in tokenizer's), each asked
#: 12 different short questions.
PREFIXES = [" ".join(f"d{d}w{i}" for i in range(120)) for d in range(4)]
REQUESTS = [f"{PREFIXES[i % 4]} question {i} " + " ".join(f"q{i}x{j}" for j in range(15)) for i in range(48)]


def example_config(
    pd_choice: str, engine_args: dict[str, list[str]] | None = None, example: str = "pd-handoff.yaml"
) -> dict:
    """The example's mesh with every listener moved to a free port of the same host, a runtime directory per agent,
    fast heartbeats and sped-up engines; `engine_args` adds arguments per instance id."""
    config = copy.deepcopy(EXAMPLES[example])
    ports = iter(free_ports(24))
    moved: dict[str, str] = {}

    def move(address: str) -> str:
        host = address.rsplit(":", 1)[0]
        return moved.setdefault(address, f"{host}:{next(ports)}")

    envoy = config["envoy"]
    for key in ("http_listen", "grpc_listen", "callback_listen"):
        envoy[key] = move(envoy.get(key, "127.0.0.1:9002"))  # the callback listener's default when unset
    envoy["base_id"] = int(envoy["http_listen"].rsplit(":", 1)[1])
    for section in ("coordinator", "conductor"):
        for key in ("listen", "metrics_listen"):
            config[section][key] = move(config[section][key])
    config["coordinator"]["heartbeat_interval_s"] = 0.5
    config["coordinator"]["scheduler"]["pd_choice"] = pd_choice
    for agent in config["node_agents"]:
        agent["listen"], agent["metrics_listen"] = move(agent["listen"]), move(agent["metrics_listen"])
        agent["runtime_dir"] = tempfile.mkdtemp(prefix=f"tandem-{agent['node_id']}-")
        agent["probe_interval_s"] = 0.5
        agent["restart"] = {"initial_backoff_s": 0.2, "max_backoff_s": 1.0}
        for engine in agent["engines"]:
            engine["port"] = int(move(f"{engine['host']}:{engine['port']}").rsplit(":", 1)[1])
            engine["args"] = ["--speedup", "20", *(engine_args or {}).get(engine["instance_id"], [])]
    return config


def engines(mesh: RunningMesh) -> dict[str, tuple[str, str]]:
    """Instance id -> (host, `host:port`) of every engine of every node."""
    return {
        e["instance_id"]: (e["host"], f"{e['host']}:{e['port']}")
        for agent in mesh.config["node_agents"]
        for e in agent["engines"]
    }


def bytes_across_hosts(mesh: RunningMesh) -> float:
    """KV bytes the engines moved to or from an engine of another host, as they count them."""
    total = 0.0
    hosts = {host for host, _ in engines(mesh).values()}
    for host, address in engines(mesh).values():
        total += sum(metric_sum(address, PEER_BYTES, peer=peer) for peer in hosts - {host})
    return total


def bytes_within_hosts(mesh: RunningMesh) -> float:
    return sum(metric_sum(address, PEER_BYTES, peer=host) for host, address in engines(mesh).values())


def routed(mesh: RunningMesh, instance_id: str) -> float:
    return mesh.coordinator_metric("tandem_coordinator_routed_requests_total", instance=instance_id)


def complete(mesh: RunningMesh, prompt: str, max_tokens: int = 8) -> httpx.Response:
    payload = {"model": "tandem-sim", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(mesh.http + "/v1/completions", json=payload, timeout=60)


def run_workload(mesh: RunningMesh) -> list[int]:
    """The request set, 4 at a time (bounded: 48 requests, 60 s each at most); the status codes in order."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return [r.status_code for r in pool.map(lambda p: complete(mesh, p), REQUESTS)]


def wait_all_registered(mesh: RunningMesh) -> None:
    ids = set(engines(mesh))

    def ready() -> bool:
        listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5).instances
        healthy = {i.instance.instance_id for i in listed if i.health == common_pb2.HEALTH_HEALTHY}
        return ids <= healthy

    mesh.wait_for(ready, 60, "all four engines registered and healthy")


def measured(example: str, pd_choice: str, tmp_path_factory) -> dict[str, float]:
    mesh = RunningMesh(example_config(pd_choice, example=example), tmp_path_factory.mktemp(pd_choice))
    mesh.start()
    try:
        wait_all_registered(mesh)
        # Through the mesh exactly as the aggregated engine answers at temperature 0 (no API key).
        reference = httpx.post(
            f"http://{engines(mesh)['prefill-0'][1]}/v1/completions",
            json={"model": "tandem-sim", "prompt": REQUESTS[0], "max_tokens": 8, "temperature": 0},
            timeout=60,
        ).json()["choices"][0]["text"]
        through = complete(mesh, REQUESTS[0])
        assert through.status_code == 200, through.text
        assert through.json()["choices"][0]["text"] == reference
        codes = run_workload(mesh)
        mesh.wait_for(lambda: mesh.stats().requests_inflight == 0, 30, "in-flight back to zero")
        return {
            "codes_ok": float(codes == [200] * len(REQUESTS)),
            "across": bytes_across_hosts(mesh),
            "within": bytes_within_hosts(mesh),
            "predicted_across": mesh.coordinator_metric(COORDINATOR_BYTES, scope="cross_node"),
            "predicted_within": mesh.coordinator_metric(COORDINATOR_BYTES, scope="intra_node"),
        }
    finally:
        mesh.stop()


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_joint_moves_fewer_bytes_across_nodes_than_least_load_decode(example, tmp_path_factory, capsys):
    separate = measured(example, "separate", tmp_path_factory)
    joint = measured(example, "joint", tmp_path_factory)
    with capsys.disabled():
        print(f"\n{example}: KV bytes across/within nodes: separate {separate}, joint {joint}")
    assert separate["codes_ok"] == 1.0 and joint["codes_ok"] == 1.0  # every request answered 200
    # Both moved KV for every request (the engines count each transfer once).
    assert separate["across"] + separate["within"] > 0 and joint["across"] + joint["within"] > 0
    assert joint["across"] < separate["across"]
    assert joint["predicted_across"] < separate["predicted_across"]


def test_a_decode_instance_without_free_kv_is_never_chosen(tmp_path_factory):
    # decode-1 has 80 blocks of 16 tokens and runs slowly: one long request sent to it directly fills its cache
    # (77 of 80 blocks for the prompt, 1,232 token ids) for the whole check, while the coordinator's ledger sees
    # it idle.
    slow = {"decode-1": ["--npu-blocks", "80", "--speedup", "0.05"]}
    config = example_config("joint", slow)
    mesh = RunningMesh(config, tmp_path_factory.mktemp("full"))
    mesh.start()
    try:
        wait_all_registered(mesh)
        decode_1 = engines(mesh)["decode-1"][1]
        hog = [100 + i % 500 for i in range(1232)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(
                httpx.post,
                f"http://{decode_1}/v1/completions",
                json={"model": "tandem-sim", "prompt": hog, "max_tokens": 40, "ignore_eos": True},
                timeout=120,
            )

            def usage() -> float:
                listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5).instances
                return next(i.load.kv_cache_usage for i in listed if i.instance.instance_id == "decode-1")

            mesh.wait_for(lambda: usage() > 0.95, 60, "decode-1 reports a full KV cache")
            # Only n2's prefill engine takes prefill legs: decode-1, on its node, would be the best pair otherwise.
            mesh.admin().DrainInstance(admin_pb2.DrainInstanceRequest(instance_id="prefill-0"), timeout=5)
            before = routed(mesh, "decode-1"), routed(mesh, "decode-0")
            codes = [complete(mesh, p).status_code for p in REQUESTS[:16]]
            after = routed(mesh, "decode-1"), routed(mesh, "decode-0")
            assert after[0] == before[0], "a request went to decode-1 while its KV cache was full"
            assert after[1] - before[1] == 16
            assert usage() > 0.95, "decode-1's cache freed during the check: the check proved nothing"
        assert codes == [200] * 16
        assert held.result().status_code == 200
    finally:
        mesh.stop()


def test_the_examples_name_both_nodes_on_loopback():
    for name in ("pd-handoff.yaml", "pd-trigger.yaml"):
        data = yaml.safe_load((ROOT / "examples" / name).read_text())
        nodes = {a["node_id"]: a for a in data["node_agents"]}
        assert set(data["coordinator"]["topology"]["nodes"]) == set(nodes) == {"n1", "n2"}
        assert data["coordinator"]["scheduler"]["pd_choice"] == "joint"
        assert data["envoy"]["http_listen"] == "127.0.0.1:8000" and "tenants" not in data["coordinator"]
        for node, host in (("n1", "127.0.0.1"), ("n2", "127.0.0.2")):
            roles = sorted(e["role"] for e in nodes[node]["engines"])
            assert roles == ["decode", "prefill"]
            assert {e["host"] for e in nodes[node]["engines"]} == {host}
            assert re.match(re.escape(host) + r":\d+$", nodes[node]["listen"])


def test_a_broken_link_falls_back_to_recompute_and_is_then_avoided(tmp_path_factory):
    """prefill-1's KV listener refuses every transfer (`--fault-kv-refuse`): with prefill-0 drained, a decode engine
    handed prefill-1's KV recomputes the prompt as vLLM does, and the answer is still the aggregated one; the decode
    engines count the failed pulls (`vllm:nixl_num_failed_transfers_total`), their heartbeats carry the counts, and
    once prefill-0 is back the coordinator leaves the failing pairs out: no further request goes to prefill-1."""
    mesh = RunningMesh(
        example_config("joint", {"prefill-1": ["--fault-kv-refuse"]}), tmp_path_factory.mktemp("broken")
    )
    mesh.start()
    try:
        wait_all_registered(mesh)
        mesh.admin().DrainInstance(admin_pb2.DrainInstanceRequest(instance_id="prefill-0"), timeout=5)
        addresses = engines(mesh)
        decodes = ("decode-0", "decode-1")

        def fallbacks() -> float:
            return sum(metric_sum(addresses[d][1], "simengine:kv_transfer_fallbacks_total") for d in decodes)

        def failures_reported() -> int:
            listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5).instances
            return sum(i.load.kv_transfer_failures_total for i in listed if i.instance.instance_id in decodes)

        def legs(prefill: str) -> float:
            return metric_sum(addresses[prefill][1], "vllm:request_success_total")

        before = fallbacks()
        prompts = REQUESTS[:8]
        reference = [
            httpx.post(
                f"http://{addresses['prefill-0'][1]}/v1/completions",
                json={"model": "tandem-sim", "prompt": p, "max_tokens": 8, "temperature": 0},
                timeout=60,
            ).json()["choices"][0]["text"]
            for p in prompts
        ]
        replies = [complete(mesh, p) for p in prompts[:4]]
        assert [r.status_code for r in replies] == [200] * 4
        assert [r.json()["choices"][0]["text"] for r in replies] == reference[:4]
        assert fallbacks() - before == 4  # every pull failed and the prompt was computed again
        assert legs("prefill-1") == 4  # each prefill leg went to the broken prefill engine
        failed = sum(metric_sum(addresses[d][1], "vllm:nixl_num_failed_transfers_total") for d in decodes)
        assert failed == 4
        mesh.wait_for(
            lambda: failures_reported() == 4, 10, "the failed pulls in the decode instances' heartbeats"
        )

        mesh.admin().UndrainInstance(admin_pb2.UndrainInstanceRequest(instance_id="prefill-0"), timeout=5)
        served_before = legs("prefill-0")
        replies = [complete(mesh, p) for p in prompts[4:]]
        assert [r.status_code for r in replies] == [200] * 4
        assert [r.json()["choices"][0]["text"] for r in replies] == reference[4:]
        assert legs("prefill-1") == 4  # the failing pairs were left out
        assert legs("prefill-0") - served_before == 4
        assert fallbacks() - before == 4  # no further recompute
    finally:
        mesh.stop()
