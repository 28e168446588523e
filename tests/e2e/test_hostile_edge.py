"""The mesh's edge against an attacker: connection floods and trickles, HTTP/2 abuse (rapid reset, CONTINUATION
flood) on the ingress and the control listener, Envoy's admin interface and its own error replies, against a real
mesh through real Envoy with mutual TLS on. docs/security.md has the table of these cases and their answers.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import stat
import time

import httpx
import pytest

from tandem import tls
from tandem.netaddr import split_host_port
from tandem.v1 import (
    admin_pb2,
    common_pb2,
    registry_pb2,
    registry_pb2_grpc,
)
from tests.e2e.hostile import FakeDecodeEngine, error_of, extra_identity, instance
from tests.helpers import RunningMesh, mesh_config, wait_until

# -- the edge: connection floods, HTTP/2 abuse, Envoy's admin interface ----------------------------------------------

EDGE_LIMIT = (
    200  # connections per listener in the edge mesh (the default is 4096: a flood that fills it is slow)
)


def edge_config(workdir) -> dict:
    """An aggregated mesh (ext_authz) with reduced connection limits and short timeouts, so that a flood that
    fills a listener stays small and the timeouts that end it stay short."""
    config = mesh_config(engines=1, engine_args=["--speedup", "20"])
    config["envoy"].update(
        max_connections=2 * EDGE_LIMIT,
        max_connections_per_listener=EDGE_LIMIT,
        first_byte_timeout_s=2.0,
        request_headers_timeout_s=2.0,
        request_body_timeout_s=1.0,
        # The decision's own time, part of the request timeout: room for a 20 MB body's Check on a loaded machine.
        ext_proc_timeout_ms=10_000,
    )
    return config


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    running = RunningMesh(edge_config(tmp_path_factory.mktemp("edge")), tmp_path_factory.mktemp("edge-run"))
    running.start()
    yield running
    running.stop()


def _health(mesh) -> int:
    try:
        return httpx.get(mesh.http + "/health", timeout=2).status_code
    except httpx.HTTPError:
        return 0


def _closed_by_peer(conn: socket.socket, timeout: float) -> bytes | None:
    """What the server sent before closing `conn` within `timeout` (None if it stayed open)."""
    conn.settimeout(timeout)
    received = b""
    try:
        while chunk := conn.recv(4096):
            received += chunk
    except TimeoutError:
        return None
    except OSError:
        pass  # reset: closed too
    return received


def test_a_connection_flood_does_not_take_the_ingress_down(edge):
    """More idle connections than the listener takes, plus clients that send headers and then trickle their body
    one byte at a time: Envoy closes the silent ones after `first_byte_timeout_s` and cuts the trickled requests
    after `request_body_timeout_s` (+ the decision's time) with 408, so probes get 200 again within seconds while the
    attacker still holds every socket it opened (before: 300 s idle, an hour of trickle, the listener full)."""
    import threading

    host, port = split_host_port(edge.config["envoy"]["http_listen"])
    assert _health(edge) == 200
    trickled = []
    for _ in range(10):  # headers, then a body byte now and then (content-length 1000)
        conn = socket.create_connection((host, port), timeout=5)
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        trickled.append(conn)
    idle = []
    for _ in range(EDGE_LIMIT + 50):  # send nothing at all; those past the limit are closed at once
        with contextlib.suppress(OSError):
            idle.append(socket.create_connection((host, port), timeout=5))
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.5):
            for conn in trickled:
                with contextlib.suppress(OSError):
                    conn.sendall(b" ")

    dripper = threading.Thread(target=trickle, daemon=True)
    dripper.start()
    started = time.monotonic()
    try:
        # Probes succeed again within a few seconds: the silent connections are closed after 2 s.
        wait_until(lambda: _health(edge) == 200, 15, "a probe answered 200 during the flood", interval=0.5)
        deadline = started + 8  # first_byte_timeout_s is 2 s
        still_open = [c for c in idle if _closed_by_peer(c, max(0.05, deadline - time.monotonic())) is None]
        assert not still_open, f"{len(still_open)} of {len(idle)} silent connections still open after 8 s"
        for conn in trickled:  # 408 after body timeout + decision (1 s + 10 s), not an hour
            reply = _closed_by_peer(conn, max(0.05, started + 40 - time.monotonic()))
            assert reply is not None and reply.startswith(b"HTTP/1.1 408"), reply
        assert time.monotonic() - started < 45
        assert _health(edge) == 200
    finally:
        stop.set()
        dripper.join(timeout=5)
        for conn in idle + trickled:
            conn.close()


def test_idle_keep_alive_connections_are_shed_near_the_limit(edge):
    """Clients that made one request and then hold their keep-alive connection: idle connections normally live
    `idle_timeout_s` (60 s), but at 90% of the listener's limit the overload manager's reduce_timeouts brings that
    down to `min_idle_timeout_s` (1 s), so they are closed within seconds and new clients get in."""
    host, port = split_host_port(edge.config["envoy"]["http_listen"])
    held = []
    try:
        for _ in range(int(EDGE_LIMIT * 0.95)):  # one request each, then silence
            conn = socket.create_connection((host, port), timeout=10)
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: tandem\r\n\r\n")
            assert conn.recv(4096).startswith(b"HTTP/1.1 200")
            held.append(conn)
        deadline = time.monotonic() + 10
        still_open = [c for c in held if _closed_by_peer(c, max(0.05, deadline - time.monotonic())) is None]
        assert len(still_open) < len(held) // 2, (
            f"{len(still_open)} of {len(held)} idle connections still open"
        )
        assert _health(edge) == 200
    finally:
        for conn in held:
            conn.close()


def test_a_20_mb_prompt_is_refused_without_max_model_len(edge):
    """The edge mesh names no `max_model_len` (as mesh files often do not): a 20 MB prompt is still refused by
    the coordinator before it is tokenized or reaches an engine, in OpenAI's shape."""
    started = time.monotonic()
    reply = httpx.post(
        edge.http + "/v1/completions",
        json={"model": "tandem-sim", "prompt": "word " * (4 * 1024 * 1024), "max_tokens": 2},
        timeout=60,
    )
    assert reply.status_code == 400, reply.text
    assert error_of(reply)["param"] == "prompt" and "max_prompt_chars" in error_of(reply)["message"]
    assert time.monotonic() - started < 20


def test_long_answers_outlive_the_request_timeout(edge):
    """The request timeout that cuts trickled bodies stops when the request reaches the engine: a streamed answer
    that lasts longer than it is not cut (and a quiet client connection between requests is not either)."""
    started = time.monotonic()
    with httpx.Client(timeout=60) as client:
        reply = client.post(
            edge.http + "/v1/completions",
            json={"model": "tandem-sim", "prompt": "hi", "max_tokens": 20000, "stream": True,
                  "ignore_eos": True},
        )  # fmt: skip
        assert reply.status_code == 200 and reply.text.rstrip().endswith("data: [DONE]")
        assert time.monotonic() - started > 11.0  # longer than request_body_timeout_s + the decision


def test_envoys_admin_interface_is_not_on_the_network(edge):
    """Envoy's admin interface (it stops Envoy with /quitquitquit) has no port: it is a unix socket in the run
    directory that only its owner may open; readiness and stats are read there."""
    from mesh.envoy import ADMIN_SOCKET_NAME

    admin = edge.run_dir / ADMIN_SOCKET_NAME
    info = admin.lstat()
    assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.getuid()
    assert edge.envoy_admin("/ready").strip() == "LIVE"
    assert "http.ingress.downstream_cx_total" in edge.envoy_admin(
        "/stats?filter=^http.ingress.downstream_cx_total"
    )
    rendered = (edge.run_dir / "envoy.yaml").read_text()
    assert "admin:\n  address:\n    pipe:" in rendered and "9901" not in rendered


def test_envoys_own_errors_are_openai_json(edge):
    """Errors Envoy answers itself are OpenAI-shaped too: a header name with an underscore (400) and an engine that
    hangs up before answering (503, Envoy's "upstream connect error or disconnect/reset before headers")."""
    import threading

    reply = httpx.post(
        edge.http + "/v1/completions",
        json={"model": "tandem-sim", "prompt": "hi", "max_tokens": 2},
        headers={"x_smuggled": "1"},
        timeout=10,
    )
    assert reply.status_code == 400 and reply.headers["content-type"].startswith("application/json")
    assert error_of(reply) == {
        "message": "Header names with underscores are not accepted.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    fake = FakeDecodeEngine(hang_up=True)
    agent = tls.channel(edge.config["coordinator"]["listen"], extra_identity(edge, "agent/n1"), "coordinator")
    registry = registry_pb2_grpc.RegistryStub(agent)
    broken = instance("broken-fake", "n1", fake.port)
    broken.role = common_pb2.ROLE_HYBRID
    broken.dispatch_capability = common_pb2.DISPATCH_CAPABILITY_AGGREGATED
    stop = threading.Event()

    def beats():
        while not stop.wait(0.2):
            yield registry_pb2.HeartbeatRequest(instance_id="broken-fake", health=common_pb2.HEALTH_HEALTHY)

    heartbeat = threading.Thread(target=lambda: list(registry.Heartbeat(beats())), daemon=True)
    admin = edge.admin()
    try:
        registry.Register(registry_pb2.RegisterRequest(instance=broken), timeout=5)
        heartbeat.start()
        admin.DrainInstance(admin_pb2.DrainInstanceRequest(instance_id="sim-0"), timeout=5)
        reply = httpx.post(
            edge.http + "/v1/completions",
            json={"model": "tandem-sim", "prompt": "hi", "max_tokens": 2},
            timeout=30,
        )
        assert fake.requests.qsize() >= 1  # it did reach the broken engine
        assert reply.status_code == 503 and reply.headers["content-type"].startswith("application/json")
        error = error_of(reply)
        assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
        assert "could not be reached" in error["message"] and "upstream" in error["message"]
    finally:
        admin.UndrainInstance(admin_pb2.UndrainInstanceRequest(instance_id="sim-0"), timeout=5)
        stop.set()
        heartbeat.join(5)
        registry.Deregister(registry_pb2.DeregisterRequest(instance_id="broken-fake"), timeout=5)
        agent.close()
        fake.close()
    assert httpx.get(edge.http + "/health", timeout=10).status_code == 200


# HTTP/2 by hand (prior knowledge, or over TLS with ALPN h2): the abuse needs frames no client library sends.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_HEADERS, H2_RST_STREAM, H2_SETTINGS, H2_GOAWAY, H2_CONTINUATION = 0x1, 0x3, 0x4, 0x7, 0x9
END_STREAM, END_HEADERS = 0x1, 0x4


def h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def hpack_literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, new name, no Huffman (names and values under 127 bytes)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def h2_request_block(
    path: bytes = b"/health", authority: bytes = b"tandem", scheme: bytes = b"http"
) -> bytes:
    return (
        hpack_literal(b":method", b"GET")
        + hpack_literal(b":scheme", scheme)
        + hpack_literal(b":path", path)
        + hpack_literal(b":authority", authority)
    )


def h2_goaway_or_closed(conn, timeout: float) -> bool:
    """Whether the server sent GOAWAY or closed the connection within `timeout` (frames before it are skipped)."""
    deadline = time.monotonic() + timeout
    buffered = b""
    while time.monotonic() < deadline:
        conn.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            return False
        except OSError:
            return True
        if not chunk:
            return True
        buffered += chunk
        while len(buffered) >= 9:
            length = int.from_bytes(buffered[:3], "big")
            if len(buffered) < 9 + length:
                break
            if buffered[3] == H2_GOAWAY:
                return True
            buffered = buffered[9 + length :]
    return False


GRPC_HEALTH_CHECK = (
    hpack_literal(b":method", b"POST")
    + hpack_literal(b":scheme", b"https")
    + hpack_literal(b":path", b"/grpc.health.v1.Health/Check")
    + hpack_literal(b":authority", b"envoy.tandem")
    + hpack_literal(b"content-type", b"application/grpc")
    + hpack_literal(b"te", b"trailers")
)


def h2_rapid_reset(
    conn, pairs: int, block: bytes | None = None, flags: int = END_HEADERS | END_STREAM
) -> int:
    """Opens and at once cancels up to `pairs` streams (CVE-2023-44487) with the header `block` (GET /health);
    how many were sent before the server ended the connection."""
    conn.sendall(H2_PREFACE + h2_frame(H2_SETTINGS, 0, 0))
    block = block or h2_request_block()
    sent = 0
    try:
        for batch in range(0, pairs, 50):
            frames = b"".join(
                h2_frame(H2_HEADERS, flags, stream, block)
                + h2_frame(H2_RST_STREAM, 0, stream, (8).to_bytes(4, "big"))  # CANCEL
                for stream in range(2 * batch + 1, 2 * (batch + 50) + 1, 2)
            )
            conn.sendall(frames)
            sent += 50
    except OSError:
        pass
    return sent


def h2_continuation_flood(conn, megabytes: int) -> int:
    """One HEADERS frame that never ends its header block, then CONTINUATION frames of 16 KiB (CVE-2024-27316);
    bytes sent before the server ended the connection."""
    conn.sendall(H2_PREFACE + h2_frame(H2_SETTINGS, 0, 0))
    conn.sendall(h2_frame(H2_HEADERS, 0, 1, h2_request_block()))
    filler = b"".join(hpack_literal(b"x-filler", b"a" * 100) for _ in range(150))  # ~16 KiB of fields
    sent = 0
    try:
        while sent < megabytes * 1024 * 1024:
            conn.sendall(h2_frame(H2_CONTINUATION, 0, 1, filler))
            sent += len(filler)
    except OSError:
        pass
    return sent


def _control_tls_socket(mesh, host: str, port: int):
    files = mesh.tls("operator")
    context = ssl.create_default_context(cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key))
    context.set_alpn_protocols(["h2"])
    context.check_hostname = False
    return context.wrap_socket(
        socket.create_connection((host, port), timeout=10), server_hostname="envoy.tandem"
    )


def _listener_connection(edge, listener: str) -> socket.socket:
    """A connection to Envoy's ingress (plain) or control listener (TLS with the operator's certificate)."""
    host, port = split_host_port(
        edge.config["envoy"]["http_listen" if listener == "ingress" else "grpc_listen"]
    )
    if listener == "control":
        return _control_tls_socket(edge, host, port)
    return socket.create_connection((host, port), timeout=10)


@pytest.mark.parametrize("listener", ["ingress", "control"])
def test_http2_rapid_reset_is_cut_off(edge, listener):
    """10,000 streams opened and cancelled at once on one connection: Envoy ends the connection long before (its
    premature-reset limit), and the listener still serves."""
    started = time.monotonic()
    with _listener_connection(edge, listener) as conn:
        if listener == "ingress":  # each stream waits for its decision when the reset comes
            sent = h2_rapid_reset(conn, 10_000)
        else:  # a gRPC call the operator may make, forwarded to the coordinator, its body never sent
            sent = h2_rapid_reset(conn, 10_000, GRPC_HEALTH_CHECK, END_HEADERS)
        assert h2_goaway_or_closed(conn, 10), f"{sent} streams opened and reset, connection still open"
    prefix = "ingress" if listener == "ingress" else "control"
    stats = edge.envoy_admin(f"/stats?filter=^http.{prefix}.downstream_rq_(too_many_premature_resets|total)$")
    counts = {
        line.split(": ")[0].rsplit("downstream_rq_", 1)[1]: int(line.split(": ")[1])
        for line in stats.splitlines()
    }
    assert counts["too_many_premature_resets"] >= 1 and counts["total"] < 1000, (
        counts
    )  # cut after a few hundred
    assert time.monotonic() - started < 20
    assert _health(edge) == 200


@pytest.mark.parametrize("listener", ["ingress", "control"])
def test_http2_continuation_flood_is_cut_off(edge, listener):
    """A header block that never ends (CONTINUATION after CONTINUATION): Envoy ends the connection once the block
    passes its header limit instead of buffering it, and the listener still serves."""
    started = time.monotonic()
    with _listener_connection(edge, listener) as conn:
        sent = h2_continuation_flood(conn, 1)  # 1 MiB of header block, far past the 60 KiB limit
        # Before: the stream was reset and the connection kept reading (and decoding) the endless block.
        assert h2_goaway_or_closed(conn, 5), f"{sent} bytes of one header block, connection still open"
    assert time.monotonic() - started < 20
    assert _health(edge) == 200
