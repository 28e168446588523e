"""An attacker on the mesh's network, against a real mesh through real Envoy with mutual TLS on (the default).

Each case is tried and must be refused with a clear answer; after the suite the mesh still serves and every
workload counter is back to zero. The layout is examples/pd-trigger.yaml's (decode-first trigger mode: callbacks
through Envoy's callback listener), with API keys on the OpenAI port and a short header timeout.
docs/security.md has the table of these cases and their answers.
"""

from __future__ import annotations

import concurrent.futures
import socket
import ssl

import grpc
import httpx
import pytest

from mesh.certs import Leaf, create_ca, issue
from tandem import tls
from tandem.netaddr import split_host_port
from tandem.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    metaserver_pb2,
    metaserver_pb2_grpc,
    node_agent_pb2,
    node_agent_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)
from tests.e2e.hostile import FakeDecodeEngine, code_and_details, error_of, extra_identity, instance
from tests.helpers import RunningMesh, free_port, mesh_config, metric_sum, wait_until

API_KEY = "sk-hostile-suite-key"
PROMPT = " ".join(f"token{i}" for i in range(64))
LAYERWISE = "MooncakeLayerwiseConnector"
DENIED = "tandem_authz_denied_total"
#: Client credentials that must never reach an engine (lower case, as the fake engines' header check reads them).
CREDENTIALS = {"cookie": "session=stolen", "api-key": "sk-azure-style"}


def hostile_config(workdir) -> dict:
    config = mesh_config(engines=2, engine_args=["--speedup", "20"])
    engines = config["node_agents"][0]["engines"]
    for engine, (iid, role) in zip(engines, [("prefill-0", "prefill"), ("decode-0", "decode")], strict=True):
        engine.update(instance_id=iid, role=role, kv_connector=LAYERWISE)
    engines[1]["env"] = {"HF_TOKEN": "hf-secret-value"}  # must not show in Admin/GetConfig
    keys = workdir / "api-keys"
    keys.write_text(f"# keys of the hostile suite\n{API_KEY}\nsk-second-key\n")
    config["coordinator"].update(pd_mode="concurrent_engine_sync", api_keys_file=str(keys))
    config["coordinator"]["limits"] = {"max_tokens": 4096, "max_n": 4}
    config["models"][0]["max_model_len"] = 8192
    config["envoy"]["request_headers_timeout_s"] = 1.0
    config["coordinator"]["max_instances_per_node"] = 8
    config.setdefault("security", {})["revoked_nodes"] = ["n-removed"]
    return config


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hostile")
    running = RunningMesh(hostile_config(workdir), workdir)
    running.start()
    yield running
    running.stop()


def auth(key: str = API_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def complete(mesh, payload: dict | None = None, headers: dict | None = None, **kw) -> httpx.Response:
    body = {"model": "tandem-sim", "prompt": PROMPT, "max_tokens": 4} | (payload or {})
    return httpx.post(
        mesh.http + "/v1/completions",
        json=body,
        headers=auth() if headers is None else headers,
        timeout=60,
        **kw,
    )


def wait_routable(mesh, iid: str) -> None:
    """Waits until the coordinator probed `iid` (a new instance is routable only once it answers /health)."""

    def healthy() -> bool:
        listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5).instances
        return any(i.instance.instance_id == iid and i.health == common_pb2.HEALTH_HEALTHY for i in listed)

    wait_until(healthy, 10, f"{iid} answered the coordinator's probe")


def test_a_fake_instance_flood_with_an_agent_certificate_is_not_routed_and_capped(mesh):
    """The issue's flood: n1's own agent certificate registers instances at an address where nothing answers, and
    at Envoy's own port. None is routable (they never answer the coordinator's probe), past the per-node cap every
    registration is refused, Envoy's address is refused outright, and user requests all succeed meanwhile."""
    agent = extra_identity(mesh, "agent/n1")
    dead = free_port()
    with tls.channel(mesh.grpc_address, agent, "coordinator") as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        codes = []
        for i in range(20):
            codes.append(
                code_and_details(
                    lambda i=i: stub.Register(
                        registry_pb2.RegisterRequest(instance=instance(f"flood-{i}", "n1", dead)), timeout=5
                    )
                )[0]
            )
        loop = instance("loop-0", "n1", split_host_port(mesh.http.removeprefix("http://"))[1])
        code, details = code_and_details(
            lambda: stub.Register(registry_pb2.RegisterRequest(instance=loop), timeout=5)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "Envoy's own listener" in details
        try:
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
            listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5).instances
            assert sum(i.instance.node_id == "n1" for i in listed) <= 8
            flood = [i for i in listed if i.instance.instance_id.startswith("flood-")]
            assert flood and all(i.health == common_pb2.HEALTH_STARTING for i in flood)
            replies = [complete(mesh) for _ in range(10)]
            assert [r.status_code for r in replies] == [200] * 10
        finally:
            for i in range(20):
                code_and_details(
                    lambda i=i: stub.Deregister(
                        registry_pb2.DeregisterRequest(instance_id=f"flood-{i}"), timeout=5
                    )
                )


# -- the control listener: no certificate, wrong CA, wrong identity ---------------------------------------------------


def test_no_certificate_cannot_even_connect(mesh):
    for address in (
        mesh.grpc_address,
        mesh.config["coordinator"]["listen"],
        mesh.config["conductor"]["listen"],
    ):
        with grpc.insecure_channel(address) as channel:
            code, _ = code_and_details(
                lambda ch=channel: admin_pb2_grpc.AdminStub(ch).ListInstances(
                    admin_pb2.ListInstancesRequest(), timeout=5
                )
            )
        assert code == grpc.StatusCode.UNAVAILABLE, address


def test_another_nodes_agent_cannot_send_kv_events_or_instance_gone_for_n1s_instances(mesh):
    """An agent certificate of node n2 streams `InstanceGone` and invented KV blocks for n1's instances to the
    conductor (directly and through Envoy): every message is dropped and counted; n1's entries stay."""
    from tandem.v1 import conductor_pb2, conductor_pb2_grpc

    assert complete(mesh).status_code == 200  # n1's engines have indexed something
    address = mesh.config["conductor"]["listen"]
    metrics = mesh.config["conductor"]["metrics_listen"]
    with mesh.channel() as channel:
        stats = conductor_pb2_grpc.ConductorStub(channel).GetIndexStats
        entries = wait_until(
            lambda: stats(conductor_pb2.GetIndexStatsRequest(), timeout=5).npu_blocks, 10, "indexed blocks"
        )
    before = metric_sum(metrics, "tandem_conductor_foreign_messages_total")
    rogue = extra_identity(mesh, "agent/n2")
    stored = conductor_pb2.BlockStored(
        block_hashes=list(range(1, 9)), token_ids=list(range(8 * 16)), block_size=16
    )
    forged = [
        conductor_pb2.IngestRequest(instance_gone=conductor_pb2.InstanceGone(instance_id="prefill-0")),
        conductor_pb2.IngestRequest(instance_gone=conductor_pb2.InstanceGone(instance_id="decode-0")),
        conductor_pb2.IngestRequest(
            batch=conductor_pb2.KvEventBatch(
                instance_id="prefill-0", sequence=10**6, model="tandem-sim", block_size=16,
                events=[conductor_pb2.KvEvent(block_stored=stored)],
            )
        ),
    ]  # fmt: skip
    for target, server in ((address, "conductor"), (mesh.grpc_address, "conductor")):
        with tls.channel(target, rogue, server) as channel:
            list(conductor_pb2_grpc.ConductorStub(channel).Ingest(iter(forged), timeout=5))
    wait_until(
        lambda: metric_sum(metrics, "tandem_conductor_foreign_messages_total") >= before + 2 * len(forged),
        10,
        "the forged messages counted",
    )
    with mesh.channel() as channel:
        after = conductor_pb2_grpc.ConductorStub(channel).GetIndexStats(
            conductor_pb2.GetIndexStatsRequest(), timeout=5
        )
    assert after.npu_blocks >= entries  # nothing erased, nothing invented for n1's instances


def test_a_removed_nodes_certificate_is_refused_on_every_listener(mesh):
    """A node taken out of the mesh (`security.revoked_nodes`) keeps a certificate the mesh CA signed: Envoy's
    control listener, the coordinator and the conductor refuse it, even for health."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    removed = extra_identity(mesh, "agent/n-removed")
    targets = [
        (mesh.grpc_address, "coordinator", "may not be called by"),  # Envoy's RBAC
        (mesh.config["coordinator"]["listen"], "coordinator", "revoked"),
        (mesh.config["conductor"]["listen"], "conductor", "revoked"),
    ]
    for address, server, reason in targets:
        with tls.channel(address, removed, server) as channel:
            if server == "coordinator":
                code, details = code_and_details(
                    lambda ch=channel: registry_pb2_grpc.RegistryStub(ch).Register(
                        registry_pb2.RegisterRequest(instance=instance("removed-0", "n-removed")), timeout=5
                    )
                )
                assert code == grpc.StatusCode.PERMISSION_DENIED and reason in details, (address, details)
            code, details = code_and_details(
                lambda ch=channel: health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            )
            assert code == grpc.StatusCode.PERMISSION_DENIED and reason in details, (address, details)
    # A current node's certificate still works.
    with tls.channel(mesh.config["conductor"]["listen"], extra_identity(mesh, "agent/n1"), "conductor") as ch:
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_certificate_from_another_ca_is_refused(mesh, tmp_path):
    create_ca(tmp_path, "Attacker CA")
    issue(tmp_path, Leaf("operator", tls.identity("operator"), ()))
    forged = tls.TlsFiles(mesh.certs / "ca.pem", tmp_path / "operator.pem", tmp_path / "operator-key.pem")
    with tls.channel(mesh.grpc_address, forged, "envoy") as channel:
        code, _ = code_and_details(
            lambda: admin_pb2_grpc.AdminStub(channel).ListInstances(
                admin_pb2.ListInstancesRequest(), timeout=5
            )
        )
    assert code == grpc.StatusCode.UNAVAILABLE


def test_rogue_register_is_refused(mesh):
    before = mesh.coordinator_metric(DENIED)
    # The operator may not register instances (Envoy's RBAC on the control listener).
    with mesh.channel("operator") as channel:
        code, details = code_and_details(
            lambda: registry_pb2_grpc.RegistryStub(channel).Register(
                registry_pb2.RegisterRequest(instance=instance("rogue-0")), timeout=5
            )
        )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "/tandem.v1.Registry/Register" in details and "spiffe://tandem/operator" in details
    # Nor directly at the coordinator's port (its own interceptor, counted in its metrics).
    with tls.channel(mesh.config["coordinator"]["listen"], mesh.tls("operator"), "coordinator") as channel:
        code, details = code_and_details(
            lambda: registry_pb2_grpc.RegistryStub(channel).Register(
                registry_pb2.RegisterRequest(instance=instance("rogue-0")), timeout=5
            )
        )
    assert code == grpc.StatusCode.PERMISSION_DENIED and "spiffe://tandem/operator" in details
    assert mesh.coordinator_metric(DENIED) > before
    listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5).instances
    assert "rogue-0" not in {i.instance.instance_id for i in listed}


@pytest.mark.parametrize("via_envoy", [True, False])
def test_another_nodes_agent_cannot_take_over_an_instance_id(mesh, via_envoy):
    rogue = extra_identity(mesh, "agent/n2")
    address = mesh.grpc_address if via_envoy else mesh.config["coordinator"]["listen"]
    with tls.channel(address, rogue, "coordinator") as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        # decode-0 is registered by n1's agent: n2's may not re-register it under its own node...
        code, details = code_and_details(
            lambda: stub.Register(
                registry_pb2.RegisterRequest(instance=instance("decode-0", "n2")), timeout=5
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED and "registered by the agent of node 'n1'" in details
        # ...nor claim to be n1...
        code, details = code_and_details(
            lambda: stub.Register(
                registry_pb2.RegisterRequest(instance=instance("decode-0", "n1")), timeout=5
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED and "only register instances of node 'n2'" in details
        # ...nor deregister it or report its health.
        code, _ = code_and_details(
            lambda: stub.Deregister(registry_pb2.DeregisterRequest(instance_id="decode-0"), timeout=5)
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        beats = iter(
            [registry_pb2.HeartbeatRequest(instance_id="decode-0", health=common_pb2.HEALTH_UNHEALTHY)]
        )
        code, _ = code_and_details(lambda: list(stub.Heartbeat(beats, timeout=5)))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    listed = {
        i.instance.instance_id: i
        for i in mesh.admin().ListInstances(admin_pb2.ListInstancesRequest()).instances
    }
    assert listed["decode-0"].instance.address == mesh.engine_address("decode-0")
    assert listed["decode-0"].health == common_pb2.HEALTH_HEALTHY


def test_drain_stop_and_launch_need_the_operator(mesh):
    agent = extra_identity(mesh, "agent/n1")  # even the node's own agent identity
    with mesh.channel("agent/n1") as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        node = node_agent_pb2_grpc.NodeAgentStub(channel)
        calls = {
            "/tandem.v1.Admin/DrainInstance": lambda: admin.DrainInstance(
                admin_pb2.DrainInstanceRequest(instance_id="decode-0"), timeout=5
            ),
            "/tandem.v1.NodeAgent/Stop": lambda: node.Stop(
                node_agent_pb2.StopRequest(instance_id="decode-0"), timeout=5
            ),
            "/tandem.v1.NodeAgent/Launch": lambda: node.Launch(
                node_agent_pb2.LaunchRequest(instance_id="decode-0"), timeout=5
            ),
            "/tandem.v1.Admin/GetConfig": lambda: admin.GetConfig(admin_pb2.GetConfigRequest(), timeout=5),
        }
        for method, call in calls.items():
            code, details = code_and_details(call)
            assert code == grpc.StatusCode.PERMISSION_DENIED, method
            assert method in details and tls.identity("agent/n1") in details
    # Directly at the node agent's own port too.
    with tls.channel(mesh.config["node_agents"][0]["listen"], agent, "agent/n1") as channel:
        code, _ = code_and_details(
            lambda: node_agent_pb2_grpc.NodeAgentStub(channel).Stop(
                node_agent_pb2.StopRequest(instance_id="decode-0"), timeout=5
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
    engines = mesh.engines()
    assert engines["decode-0"].state == node_agent_pb2.ENGINE_STATE_RUNNING
    listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5).instances
    assert not any(i.drained for i in listed)


def test_ext_proc_from_outside_is_refused(mesh):
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    def open_stream(address: str, role: str, server: str):
        with tls.channel(address, mesh.tls(role), server) as channel:
            headers = ep.ProcessingRequest(request_headers=ep.HttpHeaders())
            return code_and_details(
                lambda: list(ep_grpc.ExternalProcessorStub(channel).Process(iter([headers]), timeout=5))
            )

    # Through Envoy's control listener: not routed, and RBAC refuses it first.
    code, _ = open_stream(mesh.grpc_address, "operator", "envoy")
    assert code == grpc.StatusCode.PERMISSION_DENIED
    # Directly at the coordinator with a valid identity that is not Envoy's own connection.
    code, details = open_stream(mesh.config["coordinator"]["listen"], "operator", "coordinator")
    assert code == grpc.StatusCode.PERMISSION_DENIED and "ExternalProcessor" in details
    assert mesh.stats().requests_inflight == 0 and mesh.stats().workload_tokens == 0


# -- the callback listener -------------------------------------------------------------------------------------------


def callback(mesh, path: str, body: dict) -> httpx.Response:
    context = ssl.create_default_context(cafile=str(mesh.certs / "ca.pem"))
    return httpx.post(f"https://{mesh.callback_address}{path}", json=body, verify=context, timeout=10)


def test_forged_callbacks_are_refused(mesh):
    facts = {"remote_block_ids": [[1, 2]], "remote_host": "10.9.9.9", "remote_port": 4444}
    # A client id an attacker could know: the engines never see it, so no attempt answers to it; and an unknown
    # id is refused exactly as a wrong token is (403, same message): the answer does not tell which ids exist.
    for rid in ("cmpl-victim#a1-0", "chatcmpl-victim#a1", "cmpl-victim-0"):
        reply = callback(mesh, "/v1/metaserver/c0/guessed-token", {**facts, "request_id": rid})
        assert reply.status_code == 403, reply.text
        assert reply.json()["message"].endswith("token does not belong to an open request attempt")
    # Bodies are bounded before anything is parsed: 30 MB is 413 at once.
    context = ssl.create_default_context(cafile=str(mesh.certs / "ca.pem"))
    huge = b'{"request_id": "cmpl-x-0", "token_ids": [' + b"1," * (15 * 1024 * 1024) + b"1]}"
    reply = httpx.post(
        f"https://{mesh.callback_address}/v1/metaserver/c0/guessed-token",
        content=huge,
        headers={"content-type": "application/json"},
        verify=context,
        timeout=30,
    )
    assert reply.status_code == 413, reply.text[:200]
    # Only the metaserver is served on the callback listener.
    other = httpx.get(f"https://{mesh.callback_address}/v1/models", verify=context, timeout=10)
    assert other.status_code == 404
    # And the Metaserver is not reachable on the control listener, whoever calls.
    with mesh.channel("operator") as channel:
        code, _ = code_and_details(
            lambda: metaserver_pb2_grpc.MetaserverStub(channel).Trigger(
                metaserver_pb2.TriggerRequest(request_id="cmpl-x-0"), timeout=5
            )
        )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    # Directly at the coordinator, even Envoy's own identity is not a callback (no callback listener mark).
    with tls.channel(mesh.config["coordinator"]["listen"], mesh.tls("envoy"), "coordinator") as channel:
        code, _ = code_and_details(
            lambda: metaserver_pb2_grpc.MetaserverStub(channel).Trigger(
                metaserver_pb2.TriggerRequest(request_id="cmpl-x-0"), timeout=5
            )
        )
    assert code == grpc.StatusCode.PERMISSION_DENIED


def test_forged_callbacks_racing_a_real_attempt_are_refused(mesh):
    """The attack of the issue: while a real request waits for its decode engine's callback, forged callbacks for
    that very attempt (its real callback id) try to aim the prefill engine elsewhere. Only the decode engine got the
    token; a callback without it, or naming another host, or more blocks than the prompt fills, is refused."""
    import threading

    agent = extra_identity(mesh, "agent/n1")
    fake = FakeDecodeEngine()
    stop = threading.Event()
    coordinator = tls.channel(mesh.config["coordinator"]["listen"], agent, "coordinator")
    registry = registry_pb2_grpc.RegistryStub(coordinator)
    fake_instance = instance("decode-fake", "n1", fake.port)
    fake_instance.block_size = 16
    registry.Register(registry_pb2.RegisterRequest(instance=fake_instance), timeout=5)

    def beats():
        while not stop.wait(0.2):
            yield registry_pb2.HeartbeatRequest(instance_id="decode-fake", health=common_pb2.HEALTH_HEALTHY)

    heartbeat = threading.Thread(target=lambda: list(registry.Heartbeat(beats())), daemon=True)
    heartbeat.start()
    wait_routable(mesh, "decode-fake")
    admin = mesh.admin()
    admin.DrainInstance(admin_pb2.DrainInstanceRequest(instance_id="decode-0"), timeout=5)
    refused = "tandem_coordinator_metaserver_callbacks_total"
    before = mesh.coordinator_metric(refused, outcome="refused")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            client = pool.submit(complete, mesh, None, {**auth(), "X-Request-Id": "victim", **CREDENTIALS})
            headers, body = fake.requests.get(timeout=30)
            url = body["kv_transfer_params"]["metaserver"]
            seen = {k.lower(): v for k, v in headers.items()}
            engine_id = seen["x-request-id"]
            assert engine_id.startswith("tdm-") and "victim" not in engine_id  # minted, not the client's
            assert seen["x-tandem-client-request-id"] == "victim"
            assert "authorization" not in seen  # the mesh's API key is not the engine's business
            assert not set(CREDENTIALS) & set(seen)  # nor the client's cookies and other credentials
            token = url.rsplit("/", 1)[1]
            real = {"request_id": f"cmpl-{engine_id}-0", "remote_host": "127.0.0.1", "remote_port": 7777,
                    "remote_block_ids": [[1, 2]], "remote_block_size": [16]}  # fmt: skip
            forged = [
                (f"/v1/metaserver/c0/{token[:-2]}xx", real, "token"),
                ("/v1/metaserver/c0", real, "token"),
                (f"/v1/metaserver/c0/{token}", {**real, "remote_host": "10.9.9.9"}, "remote_host"),
                (f"/v1/metaserver/c0/{token}", {**real, "remote_block_ids": [list(range(500))]}, "KV blocks"),
                # The caller's own block size and group count no longer widen the bound (the prompt is 64 tokens,
                # the decode instance registered 16-token blocks: at most 5 per group, 4 groups).
                (
                    f"/v1/metaserver/c0/{token}",
                    {**real, "remote_block_ids": [list(range(60))], "remote_block_size": [1]},
                    "KV blocks",
                ),  # fmt: skip
                (
                    f"/v1/metaserver/c0/{token}",
                    {**real, "remote_block_ids": [[1, 2, 3, 4, 5]] * 12},
                    "KV cache groups",
                ),  # fmt: skip
            ]
            for path, facts, reason in forged:
                reply = callback(mesh, path, facts)
                assert reply.status_code == 403, (path, reply.text)
                assert reason in reply.json()["message"]
            assert mesh.coordinator_metric(refused, outcome="refused") == before + len(forged)
            fake.release.set()
            assert client.result(timeout=30).status_code == 200
    finally:
        fake.close()
        admin.UndrainInstance(admin_pb2.UndrainInstanceRequest(instance_id="decode-0"), timeout=5)
        stop.set()
        heartbeat.join(5)
        registry.Deregister(registry_pb2.DeregisterRequest(instance_id="decode-fake"), timeout=5)
        coordinator.close()
    mesh.wait_for(lambda: mesh.stats().requests_inflight == 0, 10, "in-flight back to zero")
    assert mesh.stats().workload_tokens == 0


def test_racing_duplicate_request_ids_are_harmless(mesh):
    """The same client X-Request-Id on concurrent requests (the old KeyError leaked the in-flight count)."""

    def one(i: int) -> tuple[int, str]:
        reply = complete(mesh, {"prompt": f"{i} {PROMPT}"}, headers={**auth(), "X-Request-Id": "same-id"})
        return reply.status_code, reply.headers.get("x-request-id", "")

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(32)))
    assert [code for code, _ in results] == [200] * 32
    assert {echo for _, echo in results} == {"same-id"}  # the client's id comes back
    mesh.wait_for(lambda: mesh.stats().requests_inflight == 0, 10, "in-flight back to zero")
    assert mesh.stats().workload_tokens == 0


# -- the OpenAI port -------------------------------------------------------------------------------------------------


def test_api_keys(mesh):
    missing = complete(mesh, headers={})
    assert missing.status_code == 401 and error_of(missing)["code"] == "invalid_api_key"
    wrong = complete(mesh, headers=auth("sk-wrong"))
    assert wrong.status_code == 401
    models = httpx.get(mesh.http + "/v1/models", timeout=10)
    assert models.status_code == 401
    assert complete(mesh, headers=auth("sk-second-key")).status_code == 200
    assert httpx.get(mesh.http + "/health", timeout=10).status_code == 200  # probes need no key


def test_oversize_body_is_413_in_openai_shape(mesh):
    big = b'{"model": "tandem-sim", "prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    reply = httpx.post(
        mesh.http + "/v1/completions",
        content=big,
        headers={**auth(), "Content-Type": "application/json"},
        timeout=60,
    )
    assert reply.status_code == 413
    assert error_of(reply)["type"] == "RequestEntityTooLargeError" and "32 MiB" in error_of(reply)["message"]


def test_a_body_under_envoys_limit_reaches_the_coordinator(mesh):
    """Bodies between gRPC's default 4 MiB and Envoy's 32 MiB buffer cross the ext_proc stream (the coordinator's
    message limit follows Envoy's): this one is judged on its content (too long for the model), not cut."""
    reply = complete(mesh, {"prompt": "word " * (1024 * 1024)})  # 5 MiB
    assert reply.status_code == 400, reply.text
    assert "max_model_len" in error_of(reply)["message"]


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_tokens": 8000, "prompt": PROMPT * 20}, "max_tokens"),  # beyond max_model_len with the prompt
        ({"n": 1000}, "n"),
        ({"best_of": 1000}, "best_of"),
        ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
        ({"prompt": ["p"] * 100_000}, "prompt"),
    ],
)
def test_huge_requests_are_400(mesh, payload, param):
    reply = complete(mesh, payload)
    assert reply.status_code == 400, reply.text
    assert error_of(reply)["param"] == param


def test_deeply_nested_json_is_400(mesh):
    for depth in (100, 100_000):
        nested = "[" * depth + "]" * depth
        body = '{"model": "tandem-sim", "prompt": "x", "user": ' + nested + "}"
        reply = httpx.post(
            mesh.http + "/v1/completions",
            content=body,
            headers={**auth(), "Content-Type": "application/json"},
            timeout=30,
        )
        assert reply.status_code == 400, reply.text
        assert "nests JSON" in error_of(reply)["message"]


def test_slow_headers_are_cut(mesh):
    host, port = split_host_port(mesh.config["envoy"]["http_listen"])
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\n")  # and never finishes
        conn.settimeout(10)
        received = b""
        while True:  # Envoy answers 408 and closes after request_headers_timeout (1 s here)
            chunk = conn.recv(4096)
            if not chunk:
                break
            received += chunk
    assert received == b"" or received.startswith(b"HTTP/1.1 408")


def test_get_config_hides_secrets(mesh):
    text = mesh.admin().GetConfig(admin_pb2.GetConfigRequest(), timeout=5).yaml
    assert "hf-secret-value" not in text and "<redacted>" in text


def test_the_mesh_still_serves_and_holds_nothing(mesh):
    """Last: after every case above, a normal request works and every workload counter is zero."""
    streamed = complete(mesh, {"stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert complete(mesh).status_code == 200
    wait_until(lambda: mesh.stats().requests_inflight == 0, 10, "in-flight back to zero")
    stats = mesh.stats()
    assert stats.workload_tokens == 0 and stats.requests_inflight == 0
    assert all(i.workload_tokens == 0 and i.inflight_requests == 0 for i in stats.instances)
    assert (
        metric_sum(mesh.config["coordinator"]["metrics_listen"], "tandem_coordinator_inflight_requests") == 0
    )
    assert {e.state for e in mesh.engines().values()} == {node_agent_pb2.ENGINE_STATE_RUNNING}


def test_insecure_mode_is_explicit_and_announced(tmp_path):
    """Plain text only when the mesh file says `security.insecure: true`, and then the banner says so."""
    config = mesh_config(engines=1)
    config["security"] = {"insecure": True}
    running = RunningMesh(config, tmp_path)
    running.start()
    try:
        assert "INSECURE" in running.output.read_text()
        assert not (running.run_dir / "certs").exists()
        reply = httpx.post(
            running.http + "/v1/completions",
            json={"model": "tandem-sim", "prompt": "hi", "max_tokens": 2},
            timeout=30,
        )
        assert reply.status_code == 200
        with grpc.insecure_channel(running.grpc_address) as channel:
            listed = admin_pb2_grpc.AdminStub(channel).ListInstances(
                admin_pb2.ListInstancesRequest(), timeout=5
            )
        assert [i.instance.instance_id for i in listed.instances] == ["sim-0"]
    finally:
        assert running.stop() == 0


def test_api_key_and_request_ids_on_the_ext_authz_path(tmp_path):
    """The suite above runs a P/D mesh (ext_proc); an aggregated mesh decides with ext_authz, and the same checks
    hold there: the key is required and removed before the engine (the Check's headers_to_remove), the engine gets
    a minted id, the client its own back."""
    import threading

    config = mesh_config(engines=1)
    keys = tmp_path / "api-keys"
    keys.write_text(f"{API_KEY}\n")
    config["coordinator"]["api_keys_file"] = str(keys)
    running = RunningMesh(config, tmp_path)
    running.start()
    fake = FakeDecodeEngine()
    fake.release.set()  # answers at once
    coordinator = tls.channel(
        config["coordinator"]["listen"], extra_identity(running, "agent/n1"), "coordinator"
    )
    registry = registry_pb2_grpc.RegistryStub(coordinator)
    hybrid = instance("hybrid-fake", "n1", fake.port)
    hybrid.role = common_pb2.ROLE_HYBRID
    hybrid.dispatch_capability = common_pb2.DISPATCH_CAPABILITY_AGGREGATED
    stop = threading.Event()

    def beats():  # healthy for as long as the test runs
        while not stop.wait(0.2):
            yield registry_pb2.HeartbeatRequest(instance_id="hybrid-fake", health=common_pb2.HEALTH_HEALTHY)

    heartbeat = threading.Thread(target=lambda: list(registry.Heartbeat(beats())), daemon=True)
    try:
        registry.Register(registry_pb2.RegisterRequest(instance=hybrid), timeout=5)
        heartbeat.start()
        wait_routable(running, "hybrid-fake")
        running.admin().DrainInstance(admin_pb2.DrainInstanceRequest(instance_id="sim-0"), timeout=5)
        assert complete(running, headers={}).status_code == 401
        reply = complete(running, headers={**auth(), "X-Request-Id": "client-7", **CREDENTIALS})
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-request-id"] == "client-7"
        headers, _ = fake.requests.get(timeout=30)
        seen = {k.lower(): v for k, v in headers.items()}
        assert seen["x-request-id"].startswith("tdm-") and seen["x-tandem-client-request-id"] == "client-7"
        assert "authorization" not in seen and not set(CREDENTIALS) & set(seen)
    finally:
        stop.set()
        fake.close()
        coordinator.close()
        assert running.stop() == 0
