"""Shared by benchmarks and tests: free loopback ports, waiting for a condition with a deadline, a throwaway etcd
member, and mesh configs for simulated fleets. Tests reach these through `tests.helpers` (their one helper module);
they live here so that a benchmark imports them without the test helpers' heavier imports (grpcio-testing, the
components' internals).

Waiting is always for a condition, never for a fixed time: `wait_until` (plain code) and `eventually` (asyncio) poll
a predicate until it holds and fail naming what they waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import random
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

# -- Envoy -------------------------------------------------------------------------------------------------------


def envoy_version() -> str:
    """The build of the Envoy `tandem up` runs, as `envoy --version` prints it (`<commit>/<version>/<status>/<build
    type>/<TLS library>`); "n/a" when it cannot be run."""
    from mesh.up import StartError, envoy_binary

    try:
        out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError, StartError):
        return "n/a"
    return out.split("version:")[-1].strip() or "n/a"


# -- ports -------------------------------------------------------------------------------------------------------


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's `ip_local_port_range`)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


#: Ports `free_ports` has handed out in this process: never handed out twice, so that two calls (a mesh's ports,
#: then an etcd's) cannot pick the same port before either server has bound it.
_HANDED_OUT: set[tuple[str, int]] = set()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free TCP ports on `host` (held open together so they differ), none handed out before in this
    process. They are taken below the kernel's ephemeral range when it leaves room: a port from that range can be
    taken by any process's outgoing connection between this call and the server's bind (a restarted component's
    port too), which made a mesh fail to start with "Address already in use" once in a long run."""
    low = _ephemeral_low()
    rng = random.Random()
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            s = socket.socket()
            sockets.append(s)
            for _ in range(20 if low > 10_000 else 0):
                with contextlib.suppress(OSError):  # in use: another try
                    s.bind((host, rng.randrange(10_000, low)))
                    break
            else:
                s.bind((host, 0))
            # An earlier call's port, free only because its server has not bound it yet: another try.
            if (host, s.getsockname()[1]) in _HANDED_OUT:
                sockets.pop().close()
        ports = [s.getsockname()[1] for s in sockets]
        _HANDED_OUT.update((host, p) for p in ports)
        return ports
    finally:
        for s in sockets:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One free TCP port on `host` (a process that needs several takes them with one `free_ports` call)."""
    return free_ports(1, host)[0]


# -- waiting -----------------------------------------------------------------------------------------------------


class TimedOut(AssertionError):
    """A wait's condition did not hold by its deadline: an AssertionError, so that a test fails on it; its own type,
    so that a caller can tell it from an assertion in the predicate."""


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    what: str = "",
    interval: float = 0.02,
    ignore: tuple[type[BaseException], ...] = (),
) -> Any:
    """Calls `predicate` until it returns a true value and returns that value; `TimedOut` naming `what` (or the
    predicate) after `timeout` seconds. An exception of a type in `ignore` counts as "not yet" (a server still
    starting refuses connections); any other propagates."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except ignore:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimedOut(f"timed out after {timeout:g}s waiting for {what or describe(predicate)}")
        time.sleep(interval)


async def eventually(
    predicate: Callable[[], Any], timeout: float = 10.0, what: str = "", interval: float = 0.02
) -> Any:
    """`wait_until` for asyncio: yields to the loop between calls; `predicate` may be a coroutine function."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise TimedOut(f"timed out after {timeout:g}s waiting for {what or describe(predicate)}")
        await asyncio.sleep(interval)


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """True when a GET of `url` succeeds; False while nothing answers there yet (refused, timed out, or an HTTP error
    status)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except OSError:
        return False


def describe(predicate: Callable[[], Any]) -> str:
    """The source of `predicate` (what a timed-out wait was waiting for), else its repr."""
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)


# -- etcd --------------------------------------------------------------------------------------------------------


class Etcd:
    """One throwaway etcd member on loopback (Debian's `etcd-server` and `etcd-client`). `stop` kills it as a crash
    would; `start` again brings it back on the same ports and data directory (an outage)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        # Client and peer port from one call: both are held open together, so they cannot come out the same.
        self.port, self.peer = free_ports(2)
        self.endpoint = f"127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> None:
        url, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self.peer}"
        self.process = subprocess.Popen(
            ["etcd", "--name", "tandem", "--data-dir", str(self.data_dir), "--listen-client-urls", url,
             "--advertise-client-urls", url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"tandem={peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_until(self._started, timeout, "etcd up", interval=0.1)

    def _started(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:  # e.g. a port taken meanwhile: say so now, not at the deadline
            raise RuntimeError(f"etcd exited with {self.process.returncode} (ports {self.port}, {self.peer})")
        return self.healthy()

    def healthy(self) -> bool:
        result = subprocess.run(
            ["etcdctl", "--endpoints", self.endpoint, "endpoint", "health"],
            capture_output=True,
            env={"ETCDCTL_API": "3", "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            timeout=10,
        )
        return result.returncode == 0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# -- meshes ------------------------------------------------------------------------------------------------------


def mesh_config(
    engines: int = 2,
    engine_args: list[str] | None = None,
    policy: str = "least_load",
    model: str = "tandem-sim",
    heartbeat_interval_s: float = 0.5,
) -> dict:
    """A one-node mesh of simulated engines on free ports, as a dict ready for YAML.

    The node agent gets its own runtime directory: the default, `/tmp/tandem-<node_id>`, holds the engines' KV
    event IPC sockets and would be shared by every mesh on the machine with the same node id (meshes started one
    after another in one benchmark, or by tests running at the same time)."""
    ports = free_ports(10 + engines)
    addr = [f"127.0.0.1:{p}" for p in ports]
    return {
        "envoy": {
            "http_listen": addr[0],
            "grpc_listen": addr[1],
            "callback_listen": f"127.0.0.1:{ports[9 + engines]}",
            "base_id": ports[0],
        },
        "coordinator": {
            "listen": addr[3],
            "metrics_listen": addr[4],
            "heartbeat_interval_s": heartbeat_interval_s,
            "scheduler": {"policy": policy},
        },
        "conductor": {"listen": addr[5], "metrics_listen": addr[6]},
        "models": [{"name": model}],
        "node_agents": [
            {
                "node_id": "n1",
                "runtime_dir": tempfile.mkdtemp(prefix="tandem-n1-"),
                "listen": addr[7],
                "metrics_listen": addr[8],
                "probe_interval_s": 0.5,
                "restart": {"initial_backoff_s": 0.2, "max_backoff_s": 1.0},
                "engines": [
                    {
                        "instance_id": f"sim-{i}",
                        "model": model,
                        "port": ports[9 + i],
                        "args": list(engine_args or []),
                    }
                    for i in range(engines)
                ],
            }
        ],
    }
