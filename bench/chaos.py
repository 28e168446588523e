"""Chaos on a multi-node mesh on one machine: faults injected in turn under steady streaming load.

    python -m bench.chaos [--engines-per-node 1] [--clients 6] [--gap 20] [--duration 600] [--no-etcd] [--output FILE]

Layout: three "nodes" on the loopback addresses 127.0.1.1, 127.0.2.1 and 127.0.3.1, each with its node agent and
engines (simengine) on its own address; two coordinator replicas sharing an etcd, two conductor replicas and Envoy on
127.0.0.1 (one coordinator and one conductor with `--no-etcd` or when etcd is not installed); everything but etcd
started by `tandem up`, which restarts what dies. Envoy's engines cluster is `static` (a request refused before any
byte is retried on another engine) and the instances' lease outlasts an agent restart.

Faults, in order: kill an engine; kill a node agent (its engines keep serving and are adopted); kill a whole node
(agent and engines); kill a conductor replica; kill a coordinator replica (the only one without etcd); kill etcd for
3 s; kill Envoy; freeze an engine (SIGSTOP 12 s, then SIGCONT: the agent's liveness timeout kills and restarts it
first); freeze a node agent (SIGSTOP 10 s, past the instances' lease). For each: requests sent / ok / failed from the fault until the mesh recovered plus a
settle period, how many of the failures had started before the fault (streams running on the process that died),
and the time to recover. At the end every workload counter must be back to zero.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.harness import Etcd, TimedOut, free_ports, wait_until
from bench.steady_load import SteadyLoad
from mesh.config import parse_mesh_config
from mesh.envoy import ADMIN_SOCKET_NAME, admin_get
from tandem import tls
from tandem.v1 import admin_pb2, admin_pb2_grpc, node_agent_pb2, node_agent_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
NODES = ["127.0.1.1", "127.0.2.1", "127.0.3.1"]
MODEL = "tandem-sim"
IDLE_TIMEOUT_S = 3.0
FREEZE_ENGINE_S = 12.0  # issue 23's figure: its requests must end within 5 s, not when it thaws
FREEZE_AGENT_S = 10.0  # issue 23's figure: longer than the instances' lease


def multi_node_config(engines_per_node: int = 1, speedup: float = 10, etcd: str | None = None) -> dict:
    """Three nodes on 127.0.{1,2,3}.1, each with an agent and `engines_per_node` simengines; with an etcd endpoint,
    two coordinator replicas sharing it and two conductor replicas."""
    ports = free_ports(8)
    addr = [f"127.0.0.1:{p}" for p in ports]
    agents = []
    for n, host in enumerate(NODES, start=1):
        listen, metrics, *engine_ports = free_ports(2 + engines_per_node, host)
        agents.append(
            {
                "node_id": f"n{n}",
                "listen": f"{host}:{listen}",
                "metrics_listen": f"{host}:{metrics}",
                "runtime_dir": tempfile.mkdtemp(prefix=f"tandem-chaos-n{n}-"),
                "restart": {"initial_backoff_s": 0.2, "max_backoff_s": 1.0},
                "engines": [
                    {
                        "instance_id": f"n{n}-sim-{i}",
                        "model": MODEL,
                        "host": host,
                        "port": port,
                        "args": ["--speedup", str(speedup)],
                    }
                    for i, port in enumerate(engine_ports)
                ],
            }
        )
    return {
        "envoy": {
            "http_listen": addr[0],
            "grpc_listen": addr[1],
            "callback_listen": addr[7],
            "base_id": ports[0],
            "engines_cluster": "static",
            "upstream_idle_timeout_s": IDLE_TIMEOUT_S,
        },
        "coordinator": {
            "listen": addr[3],
            "metrics_listen": addr[4],
            "heartbeat_interval_s": 0.5,
            # Engines outlive their agent: their lease covers an agent restart; a dead node's engines are still
            # named for that long, and Envoy retries what they refuse on another engine.
            "instance_ttl_s": 10,
            **({"replicas": 2, "etcd": {"endpoint": etcd, "prefix": "/chaos"}} if etcd else {}),
        },
        "conductor": {"listen": addr[5], "metrics_listen": addr[6], "replicas": 2 if etcd else 1},
        "models": [{"name": MODEL}],
        "up": {"restart": {"initial_backoff_s": 0.2, "max_backoff_s": 2.0}},
        "node_agents": agents,
    }


class UpProcess:
    """`tandem up` in a subprocess, with what the faults need to find and watch its processes."""

    def __init__(self, config: dict, workdir: Path, etcd: Etcd | None = None) -> None:
        self.config = config
        self.etcd = etcd
        self.workdir = workdir
        self.config_path = workdir / "mesh.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.run_dir = workdir / "run"
        self.output = workdir / "up.out"
        self.process: subprocess.Popen | None = None
        self.fault_at = 0.0  # monotonic time of the last fault's signal
        self.detected_at = 0.0  # when the coordinator stopped routing to a dead or hung engine

    def signal(self, pid: int, signum: int = signal.SIGKILL) -> None:
        """Sends the fault's signal, noting when (requests started before it were running at the fault)."""
        if not self.fault_at:
            self.fault_at = time.monotonic()
        os.kill(pid, signum)

    @property
    def http(self) -> str:
        return f"http://{self.config['envoy']['http_listen']}"

    def start(self, timeout: float = 120) -> None:
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mesh", "up", "--config", str(self.config_path), "--run-dir", str(self.run_dir)],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "TANDEM_NO_BANNER": "1"},
            )  # fmt: skip
        try:
            wait(
                lambda: "Tandem is up." in self.output.read_text() or self.process.poll() is not None,
                timeout,
                "up",
            )
        except TimedOut:
            tail = "\n".join(self.output.read_text().splitlines()[-30:])
            raise RuntimeError(f"tandem up not up after {timeout:g} s; its output ends:\n{tail}") from None
        if self.process.poll() is not None:
            raise RuntimeError(f"tandem up exited:\n{self.output.read_text()}")

    def stop(self) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            return self.process.wait(120)
        return self.process.returncode

    def status(self) -> dict:
        return json.loads((self.run_dir / "status.json").read_text())

    def pid(self, component: str) -> int:
        return int(self.status()[component]["pid"])

    def restarts(self, component: str) -> int:
        return int(self.status()[component]["restarts"])

    def agent_address(self, node: str) -> str:
        return next(a["listen"] for a in self.config["node_agents"] if a["node_id"] == node)

    def channel(self, address: str, server_role: str) -> grpc.Channel:
        """A channel to one process of the mesh with the operator's certificate (`tandem up` made it)."""
        return tls.channel(address, tls.TlsFiles.for_role(self.run_dir / "certs", "operator"), server_role)

    def engines(self, node: str) -> dict[str, node_agent_pb2.EngineStatus]:
        with self.channel(self.agent_address(node), f"agent/{node}") as channel:
            reply = node_agent_pb2_grpc.NodeAgentStub(channel).GetStatus(
                node_agent_pb2.GetStatusRequest(), timeout=2
            )
        return {e.instance.instance_id: e for e in reply.engines}

    def replicas(self, section: str) -> list[str]:
        """gRPC addresses of the coordinator's or conductor's replicas."""
        return getattr(parse_mesh_config(self.config), section).replica_endpoints

    def component(self, section: str, index: int) -> str:
        """The name `tandem up` gives a replica."""
        if self.config[section].get("replicas", 1) == 1:
            return section
        return f"coordinator-c{index}" if section == "coordinator" else f"conductor-{index}"

    def admin(self, call: str, request, address: str | None = None):
        with self.channel(address or self.config["coordinator"]["listen"], "coordinator") as channel:
            return getattr(admin_pb2_grpc.AdminStub(channel), call)(request, timeout=2)

    def healthy_instances(self) -> set[str]:
        """Instances every coordinator replica sees healthy."""
        seen = []
        for address in self.replicas("coordinator"):
            listed = self.admin("ListInstances", admin_pb2.ListInstancesRequest(), address).instances
            seen.append({i.instance.instance_id for i in listed if i.health == 2})
        return set.intersection(*seen)

    def all_instances(self) -> set[str]:
        return {e["instance_id"] for a in self.config["node_agents"] for e in a["engines"]}

    def serving(self, address: str, server_role: str) -> bool:
        with self.channel(address, server_role) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def envoy_ready(self) -> bool:
        return admin_get(self.run_dir / ADMIN_SOCKET_NAME, "/ready", timeout=1)[0] == 200


#: What a check of a mesh in the middle of a fault may raise while it recovers: "not yet", not a failure.
TRANSIENT = (grpc.RpcError, OSError, KeyError, ValueError, TypeError)
#: `wait(predicate, timeout, what)`: the shared wait, every tenth of a second, through transient errors.
wait = functools.partial(wait_until, interval=0.1, ignore=TRANSIENT)


# --- faults: each injects itself and returns the predicate that says the mesh recovered ------------------------


def kill_engine(up: UpProcess) -> Callable[[], bool]:
    iid = next(iter(up.engines("n1")))
    old = up.engines("n1")[iid].pid
    up.signal(old)

    def back() -> bool:
        if not up.detected_at and iid not in up.healthy_instances():
            up.detected_at = time.monotonic()  # the coordinator no longer routes to it
        engine = up.engines("n1")[iid]
        running = engine.state == node_agent_pb2.ENGINE_STATE_RUNNING
        return running and engine.pid not in (0, old) and iid in up.healthy_instances()

    return back


def kill_agent(up: UpProcess) -> Callable[[], bool]:
    before = {iid: e.pid for iid, e in up.engines("n2").items()}
    restarts = up.restarts("agent-n2")
    up.signal(up.pid("agent-n2"))

    def adopted() -> bool:
        if up.restarts("agent-n2") <= restarts:
            return False
        now = up.engines("n2")
        return (
            all(e.adopted and e.pid == before[iid] for iid, e in now.items())
            and set(now) <= up.healthy_instances()
        )

    return adopted


def kill_node(up: UpProcess) -> Callable[[], bool]:
    engines = {iid: e.pid for iid, e in up.engines("n3").items()}
    restarts = up.restarts("agent-n3")
    up.signal(up.pid("agent-n3"))
    for pid in engines.values():
        up.signal(pid)

    def back() -> bool:
        if up.restarts("agent-n3") <= restarts:
            return False
        now = up.engines("n3")
        fresh = all(
            e.pid not in (0, engines[iid]) and e.state == node_agent_pb2.ENGINE_STATE_RUNNING
            for iid, e in now.items()
        )
        return fresh and set(now) <= up.healthy_instances()

    return back


def kill_component(
    which: str | Callable[[UpProcess], str], ready: Callable[[UpProcess], bool]
) -> Callable[[UpProcess], Callable[[], bool]]:
    def inject(up: UpProcess) -> Callable[[], bool]:
        name = which(up) if callable(which) else which
        restarts = up.restarts(name)
        up.signal(up.pid(name))
        return lambda: up.restarts(name) > restarts and up.status()[name]["pid"] is not None and ready(up)

    return inject


def hang_engine(up: UpProcess) -> Callable[[], bool]:
    """An engine frozen (SIGSTOP) for `FREEZE_ENGINE_S`: the agent reports it UNRESPONSIVE and stops its routing
    within ~1.5 s, and kills it after its liveness timeout (3 s), which ends the requests on it; it is restarted."""
    iid = next(iter(up.engines("n1")))
    pid = up.engines("n1")[iid].pid
    up.signal(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    state = {"resumed": False}

    def recovered() -> bool:
        if not state["resumed"]:
            if not up.detected_at:
                if iid in up.healthy_instances():
                    return False  # not ejected yet
                up.detected_at = time.monotonic()
            if time.monotonic() - stopped_at < FREEZE_ENGINE_S:
                return False
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)  # gone already: killed by the agent's liveness timeout
            state["resumed"] = True
        return iid in up.healthy_instances()

    return recovered


def freeze_agent(up: UpProcess) -> Callable[[], bool]:
    """A node agent frozen (SIGSTOP) for `FREEZE_AGENT_S`: its engines still answer, so they stay routable (the
    coordinator asks them itself once the agent is silent) and nothing fails."""
    pid = up.pid("agent-n2")
    up.signal(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    state = {"resumed": False}

    def recovered() -> bool:
        if not state["resumed"]:
            if time.monotonic() - stopped_at < FREEZE_AGENT_S:
                return False
            os.kill(pid, signal.SIGCONT)
            state["resumed"] = True
        return (
            up.serving(up.agent_address("n2"), "agent/n2") and set(up.engines("n2")) <= up.healthy_instances()
        )

    return recovered


@dataclass(frozen=True)
class Fault:
    name: str
    inject: Callable[[UpProcess], Callable[[], bool]]
    collateral_free: bool  # only requests running on the faulty process may fail


def kill_etcd(up: UpProcess) -> Callable[[], bool]:
    """etcd dies for 3 s: the replicas serve from their last known state, then catch up."""
    etcd = up.etcd
    assert etcd is not None and etcd.process is not None
    up.signal(etcd.process.pid)
    etcd.process.wait()
    down_at = time.monotonic()

    def back() -> bool:
        assert etcd.process is not None
        if etcd.process.poll() is not None:
            if time.monotonic() - down_at < 3.0:
                return False
            etcd.start()
        return up.healthy_instances() == up.all_instances()

    return back


def last_replica(section: str) -> Callable[[UpProcess], str]:
    return lambda up: up.component(section, len(up.replicas(section)) - 1)


def replicas_serving(section: str) -> Callable[[UpProcess], bool]:
    def ready(up: UpProcess) -> bool:
        every = all(up.serving(a, section) for a in up.replicas(section))
        return every and (section != "coordinator" or up.healthy_instances() == up.all_instances())

    return ready


FAULTS = [
    Fault("kill an engine", kill_engine, True),
    Fault("kill a node agent", kill_agent, True),
    Fault("kill a whole node", kill_node, True),
    Fault(
        "kill a conductor replica",
        kill_component(last_replica("conductor"), replicas_serving("conductor")),
        True,
    ),
    Fault(
        "kill a coordinator replica",
        kill_component(last_replica("coordinator"), replicas_serving("coordinator")),
        True,
    ),
    Fault("kill etcd (3 s)", kill_etcd, True),
    Fault("kill Envoy", kill_component("envoy", UpProcess.envoy_ready), False),
    Fault(f"freeze an engine (SIGSTOP {FREEZE_ENGINE_S:g} s)", hang_engine, True),
    Fault(f"freeze a node agent (SIGSTOP {FREEZE_AGENT_S:g} s)", freeze_agent, True),
]


def faults_for(up: UpProcess) -> list[Fault]:
    """The faults this layout has (no etcd fault without etcd)."""
    return [f for f in FAULTS if up.etcd is not None or f.inject is not kill_etcd]


@dataclass
class FaultResult:
    fault: str
    sent: int
    ok: int
    failed: int
    failed_running_at_fault: (
        int  # failures that started before the fault (or before a dead or hung engine was noticed)
    )
    recover_s: float
    collateral_free: bool
    errors: list[str]

    @property
    def collateral(self) -> int:
        return self.failed - self.failed_running_at_fault


def run_fault(
    up: UpProcess, load: SteadyLoad, fault: Fault, settle_s: float, timeout_s: float = 60
) -> FaultResult:
    wait(
        lambda: up.healthy_instances() == up.all_instances(),
        timeout_s,
        "every engine healthy before the fault",
    )
    up.fault_at = up.detected_at = 0.0
    recovered = fault.inject(up)
    started = up.fault_at
    wait(recovered, timeout_s, f"recovery from {fault.name!r}")
    recover_s = time.monotonic() - started
    served = load.count(ok=True)
    wait(lambda: load.count(ok=True) >= served + 6, timeout_s, "requests served after the recovery")
    time.sleep(settle_s)  # the window keeps what ends late (bounded streams)
    end = time.monotonic()
    report = load.report(started, end)
    with load._lock:
        failed = [o for o in load.outcomes if started <= o.ended < end and not o.ok]
    # On the faulty process: running when it died, or routed to it before the coordinator noticed (a hung engine
    # answers nothing; a dead one refuses, and Envoy's one retry may pick another engine that is not yet known dead).
    early = sum(1 for o in failed if o.started < max(started, up.detected_at))
    return FaultResult(
        fault.name, report.sent, report.ok, report.failed, early, recover_s, fault.collateral_free,
        [o.error for o in failed],
    )  # fmt: skip


def run_chaos(
    up: UpProcess,
    clients: int = 6,
    gap_s: float = 1.0,
    duration_s: float = 0.0,
    faults: list[Fault] | None = None,
) -> list[FaultResult]:
    """Runs the faults in turn under steady load, once each, or cycling until `duration_s` has passed; returns one
    result per fault injected."""
    load = SteadyLoad(up.http, MODEL, clients=clients, max_tokens=24, timeout_s=30).start()
    results = []
    started = time.monotonic()
    try:
        wait(lambda: load.count(ok=True) >= 2 * clients, 60, "load flowing")
        while True:
            for fault in faults or faults_for(up):
                results.append(run_fault(up, load, fault, settle_s=1.0))
                time.sleep(gap_s)
                if duration_s and time.monotonic() - started >= duration_s:
                    return results
            if not duration_s:
                return results
    finally:
        load.stop()


def workload_zero(up: UpProcess) -> bool:
    """Every workload counter of every coordinator replica is back to zero."""
    for address in up.replicas("coordinator"):
        stats = up.admin("GetStats", admin_pb2.GetStatsRequest(), address)
        if stats.requests_inflight or stats.workload_tokens:
            return False
    return True


def table(results: list[FaultResult]) -> str:
    """One row per fault kind (summed over its occurrences; recovery as the worst)."""
    lines = [
        "| fault | times | sent | ok | failed | of which on the faulty process | recovered in (worst) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r.fault for r in results):
        rs = [r for r in results if r.fault == name]
        lines.append(
            f"| {name} | {len(rs)} | {sum(r.sent for r in rs)} | {sum(r.ok for r in rs)} | "
            f"{sum(r.failed for r in rs)} | {sum(r.failed_running_at_fault for r in rs)} | "
            f"{max(r.recover_s for r in rs):.1f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines-per-node", type=int, default=1)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--gap", type=float, default=20.0, help="seconds between faults")
    parser.add_argument(
        "--duration", type=float, default=0.0, help="cycle the faults this long (0: each once)"
    )
    parser.add_argument(
        "--no-etcd",
        action="store_true",
        help="one coordinator and one conductor, no etcd (a lone coordinator's kill: issue 23's 1 s goal)",
    )
    parser.add_argument("--output", default=None, help="markdown file for the table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tandem-chaos-") as tmp:
        etcd = Etcd(Path(tmp) / "etcd") if shutil.which("etcd") and not args.no_etcd else None
        if etcd is not None:
            etcd.start()
        else:
            print("no etcd: one coordinator and one conductor", file=sys.stderr)
        up = UpProcess(
            multi_node_config(args.engines_per_node, etcd=etcd.endpoint if etcd else None), Path(tmp), etcd
        )
        try:  # a mesh that did not come up is stopped too: its processes would outlive this bench
            up.start()
            results = run_chaos(up, args.clients, args.gap, args.duration)
            wait(lambda: workload_zero(up), 60, "workload back to zero")
        finally:
            up.stop()
            if etcd is not None:
                etcd.stop()
    text = table(results)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
