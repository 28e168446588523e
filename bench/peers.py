"""Peer routers from PyPI (`sglang-router`, `vllm-router`, Rust), started in front of the same engines as Tandem.

Both bind 127.0.0.1 only, their Prometheus exporters included; logs go to a file in the work directory.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.harness import TimedOut, free_ports, http_ok, wait_until

#: label -> (router, policy)
PEERS: dict[str, tuple[str, str]] = {
    "sglang-router round_robin": ("sglang", "round_robin"),
    "sglang-router cache_aware": ("sglang", "cache_aware"),
    "vllm-router round_robin": ("vllm", "round_robin"),
    "vllm-router cache_aware": ("vllm", "cache_aware"),
}


def _command(router: str, policy: str, port: int, prom: int, workers: list[str]) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1"]
    common += ["--prometheus-port", str(prom), "--policy", policy, "--worker-urls", *workers]
    if router == "sglang":
        return [sys.executable, "-m", "sglang_router.launch_router", *common, "--log-level", "warn"]
    bin_dir = Path(sys.executable).parent
    return [str(bin_dir / "vllm-router"), *common, "--log-level", "warning"]


def version(router: str) -> str:
    """Installed version of a peer router's package."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    try:
        return pkg_version("sglang-router" if router == "sglang" else "vllm-router")
    except PackageNotFoundError:
        return "not installed"


@dataclass
class PeerRouter:
    """A running peer router."""

    label: str
    process: subprocess.Popen
    url: str  # base URL, http://127.0.0.1:PORT

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_peer(label: str, engines: list[str], workdir: Path, timeout_s: float = 60.0) -> PeerRouter:
    """Starts the peer `label` (a key of PEERS) over engine addresses `host:port`; waits until it routes."""
    router, policy = PEERS[label]
    port, prom = free_ports(2)
    workers = [f"http://{e}" for e in engines]
    log = open(workdir / f"{label.replace(' ', '-')}.log", "wb")
    proc = subprocess.Popen(
        _command(router, policy, port, prom, workers), stdout=log, stderr=subprocess.STDOUT
    )
    peer = PeerRouter(label, proc, f"http://127.0.0.1:{port}")

    def routes() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{label} exited with {proc.returncode}; see {log.name}")
        return http_ok(peer.url + "/v1/models", 2)

    try:
        wait_until(routes, timeout_s, label, 0.2)
    except TimedOut:
        peer.stop()
        raise RuntimeError(f"{label} did not answer within {timeout_s:.0f} s; see {log.name}") from None
    return peer
