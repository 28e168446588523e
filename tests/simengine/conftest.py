"""Helpers to run simulated engines as real subprocesses on 127.0.0.1 with free ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.helpers import ROOT, free_port, wait_until


class EngineProc:
    """A running `python -m simengine`; `url` is its base URL."""

    def __init__(self, *args: str, wait: bool = True, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "simengine", "--port", str(self.port), *args]
        environ = {**os.environ, **env} if env else None
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ
        )
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 10.0) -> None:
        def healthy() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited: {self.proc.stderr.read().decode()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=0.5) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(healthy, timeout, "the engine's /health")

    def post(
        self, path: str, body: dict, headers: dict | None = None, timeout: float = 20.0
    ) -> tuple[int, dict]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stream(self, path: str, body: dict, headers: dict | None = None) -> list[str]:
        """Raw SSE `data:` payloads of a streamed request."""
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(req, timeout=20) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            text = r.read().decode()
        return [line[6:] for line in text.split("\n") if line.startswith("data: ")]

    def get(self, path: str) -> tuple[int, bytes]:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return r.status, r.read()

    def metric(self, name: str) -> float:
        """Sum of a metric's samples (all label sets)."""
        _, body = self.get("/metrics")
        total = 0.0
        for line in body.decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return self.proc.returncode


@pytest.fixture
def engines():
    """Factory: `engines(*args)` starts an engine; all are stopped at teardown."""
    started: list[EngineProc] = []

    def start(*args: str, wait: bool = True, env: dict[str, str] | None = None) -> EngineProc:
        e = EngineProc(*args, wait=wait, env=env)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


@pytest.fixture(scope="module")
def engine():
    """One plain engine shared by a test module."""
    e = EngineProc("--speedup", "1000", "--served-model-name", "sim", "alias")
    yield e
    e.stop()
