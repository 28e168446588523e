"""What the hostile suites (`test_hostile.py`, `test_hostile_edge.py`) share: an attacker's tools."""

from __future__ import annotations

import json

import grpc
import httpx

from mesh.certs import Leaf, issue
from tandem import tls
from tandem.v1 import common_pb2


def error_of(reply: httpx.Response) -> dict:
    return reply.json()["error"]


def extra_identity(mesh, role: str) -> tls.TlsFiles:
    """A certificate for `role` from the mesh's own CA (what a stolen or misused identity would be)."""
    stem = tls.file_stem(role)
    if not (mesh.certs / f"{stem}.pem").exists():
        issue(mesh.certs, Leaf(stem, tls.identity(role), ()))
    return tls.TlsFiles.for_role(mesh.certs, role)


def code_and_details(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def instance(iid: str, node: str = "n1", port: int = 1) -> common_pb2.Instance:
    return common_pb2.Instance(
        instance_id=iid,
        model="tandem-sim",
        address=f"127.0.0.1:{port}",
        role=common_pb2.ROLE_DECODE,
        dispatch_capability=common_pb2.DISPATCH_CAPABILITY_TRIGGER,
        node_id=node,
    )


class FakeDecodeEngine:
    """A decode engine the test controls: it records each request and answers only when told, so forged callbacks
    can race a real request attempt while it waits for its prefill."""

    def __init__(self, hang_up: bool = False) -> None:
        import http.server
        import queue
        import threading

        self.requests: queue.Queue = queue.Queue()
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name; the coordinator's probe of /health
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.put((dict(self.headers), body))
                if hang_up:  # a broken engine: the connection ends before any answer
                    self.close_connection = True
                    return
                outer.release.wait(30)
                answer = json.dumps(
                    {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}
                )
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer.encode())

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
