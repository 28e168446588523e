"""A throwaway etcd member on loopback for tests (Debian's `etcd-server`; tests skip where it is missing)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers import free_port, wait_until


class Etcd:
    """One throwaway etcd member on loopback."""

    def __init__(self, data_dir) -> None:
        self.data_dir = data_dir
        self.port, self.peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        url, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer}"
        self.process = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", str(self.data_dir), "--listen-client-urls", url,
             "--advertise-client-urls", url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"t={peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_until(self.healthy, 20, "etcd up")

    def healthy(self) -> bool:
        result = subprocess.run(
            ["etcdctl", "--endpoints", self.endpoint, "endpoint", "health"],
            capture_output=True, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"}, timeout=10,
        )  # fmt: skip
        return result.returncode == 0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def etcd(tmp_path):
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        pytest.skip("etcd not installed (apt-get install -y etcd-server etcd-client)")
    server = Etcd(tmp_path / "etcd")
    server.start()
    yield server
    server.stop()
