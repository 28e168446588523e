"""Identities, who is calling, and authorization by certificate identity over a real TLS port."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.certs import ensure_certs
from mesh.config import parse_mesh_config
from tandem import authz, tls
from tandem.config_file import ConfigError
from tandem.grpc_server import GrpcApp


def test_identities():
    assert tls.identity("agent/n1") == "spiffe://tandem/agent/n1"
    assert tls.role_of("spiffe://tandem/operator") == "operator"
    assert tls.role_of("spiffe://other/operator") is None and tls.role_of("spiffe://tandem/") is None
    assert tls.server_name("agent/n1") == "agent-n1.tandem" and tls.agent_node("agent/n1") == "n1"
    assert tls.agent_node("operator") is None


def test_caller_role():
    envoy = {"peer_uri": [b"spiffe://tandem/envoy"]}
    agent = {"peer_uri": [b"spiffe://tandem/agent/n1"]}
    xfcc = "By=spiffe://tandem/envoy;Hash=ab;URI=spiffe://tandem/operator"
    assert tls.caller_role(agent, []) == "agent/n1"
    assert tls.caller_role(agent, [(tls.XFCC_HEADER, xfcc)]) == "agent/n1"  # only Envoy may speak for others
    assert tls.caller_role(envoy, []) == "envoy"  # Envoy's own call (ext_proc)
    assert tls.caller_role(envoy, [(tls.XFCC_HEADER, xfcc)]) == "operator"
    assert tls.caller_role(envoy, [(tls.LISTENER_HEADER, "callback")]) == "callback"
    assert tls.caller_role(envoy, [(tls.LISTENER_HEADER, "control")]) is None
    assert tls.caller_role({}, []) is None
    assert tls.forwarded_role("URI=spiffe://tandem/a;By=x,By=y;URI=spiffe://tandem/agent/n2") == "agent/n2"


def test_rules():
    rules = {"/s.A/": ("operator",), "/s.A/Read": ("operator", "agent/*"), "/s.B/M": ("*",)}
    assert authz.is_allowed(rules, "/s.A/Read", "agent/n1")
    assert not authz.is_allowed(rules, "/s.A/Write", "agent/n1")
    assert authz.is_allowed(rules, "/s.A/Write", "operator")
    assert authz.is_allowed(rules, "/s.B/M", "coordinator") and not authz.is_allowed(rules, "/s.B/M", None)
    assert not authz.is_allowed(rules, "/s.C/M", "operator")  # unlisted: refused
    assert not authz.role_matches("agent/*", "agent/") and authz.role_matches("agent/*", "agent/x")


def test_missing_tls_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="operator-key.pem"):
        (tmp_path / "ca.pem").write_text("x")
        (tmp_path / "operator.pem").write_text("x")
        tls.TlsFiles.for_role(tmp_path, "operator")


async def test_a_tls_port_checks_each_caller(tmp_path):
    ensure_certs(tmp_path, parse_mesh_config({"node_agents": [{"node_id": "n1"}]}))
    rules = {"/grpc.health.v1.Health/Check": ("operator",)}
    app = GrpcApp("t", "127.0.0.1:0", tls=tls.TlsFiles.for_role(tmp_path, "coordinator"), rules=rules)
    await app.start()
    address = f"127.0.0.1:{app.bound_port}"
    try:
        before = authz.DENIED.labels("/grpc.health.v1.Health/Check", "agent/n1")._value.get()
        async with tls.aio_channel(address, tls.TlsFiles.for_role(tmp_path, "operator"), "coordinator") as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        async with tls.aio_channel(address, tls.TlsFiles.for_role(tmp_path, "agent/n1"), "coordinator") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert (
                "spiffe://tandem/agent/n1" in info.value.details() and "Health/Check" in info.value.details()
            )
            # Watch (a stream written with context.write) is open to every mesh identity.
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=5)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        assert authz.DENIED.labels("/grpc.health.v1.Health/Check", "agent/n1")._value.get() == before + 1
        # The server proves its role: a client expecting the conductor refuses the coordinator's certificate.
        async with tls.aio_channel(address, tls.TlsFiles.for_role(tmp_path, "operator"), "conductor") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        await app.server.stop(0)


class FakeContext:
    def __init__(self, identities, metadata=()):
        self._identities, self._metadata = identities, metadata

    def peer_identities(self):
        return self._identities

    def invocation_metadata(self):
        return self._metadata

    def auth_context(self):
        return {"peer_uri": [b"spiffe://tandem/conductor"]}


def test_caller_role_of_a_call():
    assert (
        tls.context_caller_role(FakeContext([b"spiffe://tandem/agent/n1", b"agent-n1.tandem"])) == "agent/n1"
    )
    xfcc = (tls.XFCC_HEADER, "By=spiffe://tandem/envoy;URI=spiffe://tandem/operator")
    assert tls.context_caller_role(FakeContext([b"spiffe://tandem/envoy"], [xfcc])) == "operator"
    assert tls.context_caller_role(FakeContext([b"spiffe://tandem/envoy"])) == "envoy"
    assert tls.context_caller_role(FakeContext([b"other.example"])) is None
    assert tls.context_caller_role(FakeContext(None)) == "conductor"  # no identities: the full auth context
