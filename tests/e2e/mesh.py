"""A whole mesh started with `tandem up` on free loopback ports, as a user would run it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tandem import tls
from tandem.v1 import admin_pb2, admin_pb2_grpc, node_agent_pb2, node_agent_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tandem up exited:\n{self.output.read_text()}")
            if "Tandem is up." in self.output.read_text():
                return
            time.sleep(0.2)
        raise RuntimeError(f"tandem up not ready in {timeout}s:\n{self.output.read_text()}")

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
        return self.admin().GetStats(admin_pb2.GetStatsRequest(), timeout=5)

    def wait_for(self, predicate, timeout: float = 30, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

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
