"""Supervision of one engine process: launch, health, load scraping, restart with backoff, stop.

State machine: STARTING -> RUNNING -> (exit) BACKOFF -> STARTING ... -> FAILED after a crash loop;
STOPPED on request. Every transition is reported to the agent through `on_change`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from node_agent.config import EngineConfig, RestartPolicy
from node_agent.launch import LaunchSpec

log = logging.getLogger(__name__)


class EngineState(enum.Enum):
    """Mirrors `tandem.v1.EngineState`."""

    STARTING = 1
    RUNNING = 2
    BACKOFF = 3
    STOPPED = 4
    FAILED = 5


@dataclass(slots=True)
class EngineLoad:
    """Load read from the engine's `/metrics`."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    sampled_at: float = 0.0


def parse_load(text: str) -> EngineLoad:
    """vLLM's load gauges, summed over engines/ranks of one server (older `gpu_cache_usage_perc` accepted)."""
    load = EngineLoad(sampled_at=time.time())
    usage: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                load.running += int(sample.value)
            elif sample.name == "vllm:num_requests_waiting":
                load.waiting += int(sample.value)
            elif sample.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                usage.append(sample.value)
    load.kv_cache_usage = max(usage) if usage else 0.0
    return load


def backoff_delay(policy: RestartPolicy, consecutive_failures: int) -> float:
    """Exponential: initial, 2x initial, ... capped at `max_backoff_s`."""
    return min(policy.max_backoff_s, policy.initial_backoff_s * 2 ** max(0, consecutive_failures - 1))


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the agent dies, so that no engine outlives a killed agent (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EngineSupervisor:
    """Runs and watches one engine until `stop()`."""

    def __init__(
        self,
        engine: EngineConfig,
        spec: LaunchSpec,
        policy: RestartPolicy,
        log_path: str,
        probe_interval_s: float,
        stop_grace_s: float,
        on_change: Callable[[EngineSupervisor], Awaitable[None]],
    ) -> None:
        self.engine = engine
        self.spec = spec
        self.policy = policy
        self.log_path = log_path
        self.probe_interval_s = probe_interval_s
        self.stop_grace_s = stop_grace_s
        self.on_change = on_change
        self.state = EngineState.STOPPED
        self.detail = ""
        self.healthy = False
        self.load = EngineLoad()
        self.restarts = 0
        self.consecutive_failures = 0
        self.last_exit_code: int | None = None
        self.started_at = 0.0  # monotonic, for the crash-loop rule
        self.started_wall = 0.0  # wall clock, for status
        self.process: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def base_url(self) -> str:
        """The engine's HTTP root."""
        host = f"[{self.engine.host}]" if ":" in self.engine.host else self.engine.host
        return f"http://{host}:{self.engine.port}"

    def start(self) -> None:
        """Starts supervising (launches the engine); a no-op while already supervised."""
        if self._task is None or self._task.done():
            self._stopping = False
            self.consecutive_failures = 0
            self._task = asyncio.create_task(self._supervise(), name=f"engine-{self.engine.instance_id}")

    async def stop(self) -> None:
        """Stops the engine (SIGTERM, SIGKILL after the grace period) and supervision."""
        self._stopping = True
        await self._terminate()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._set(EngineState.STOPPED, "stopped on request")

    async def _set(self, state: EngineState, detail: str = "") -> None:
        changed = state != self.state or detail != self.detail
        self.state, self.detail = state, detail
        if state is not EngineState.RUNNING:
            self.healthy = False
        if changed:
            await self.on_change(self)

    async def _supervise(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while not self._stopping:
                code = await self._run_once(http)
                if self._stopping:
                    return
                self.last_exit_code = code
                ran_for = time.monotonic() - self.started_at
                self.consecutive_failures = 1 if ran_for >= self.policy.stable_after_s else self.consecutive_failures + 1
                if self.consecutive_failures >= self.policy.max_consecutive_failures:
                    await self._set(
                        EngineState.FAILED,
                        f"exited with code {code}; {self.consecutive_failures} failures in a row, not restarting "
                        f"(log: {self.log_path})",
                    )
                    log.error("engine crash loop, giving up", extra=self._log_fields())
                    return
                delay = backoff_delay(self.policy, self.consecutive_failures)
                await self._set(EngineState.BACKOFF, f"exited with code {code}, restart in {delay:g}s")
                log.warning("engine exited, restarting", extra={**self._log_fields(), "delay_s": delay})
                await asyncio.sleep(delay)
                self.restarts += 1

    async def _run_once(self, http: aiohttp.ClientSession) -> int:
        """Launches, waits for health, then watches until the process exits; returns its exit code."""
        await self._set(EngineState.STARTING, "waiting for /health")
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.process = await asyncio.create_subprocess_exec(
                *self.spec.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env={**os.environ, **self.spec.env},
                preexec_fn=_die_with_parent,
            )
        self.started_at = time.monotonic()
        self.started_wall = time.time()
        log.info("engine launched", extra={**self._log_fields(), "pid": self.process.pid})
        exited = asyncio.create_task(self.process.wait())
        try:
            deadline = time.monotonic() + self.engine.health_timeout_s
            while not await self._probe(http):
                if exited.done():
                    return exited.result()
                if time.monotonic() > deadline:
                    self.detail = f"no /health after {self.engine.health_timeout_s:g}s"
                    await self._terminate()
                    return await exited
                await asyncio.sleep(0.1)
            self.healthy = True
            await self._set(EngineState.RUNNING)
            while not exited.done():
                await asyncio.wait({exited}, timeout=self.probe_interval_s)
                if exited.done():
                    break
                healthy = await self._probe(http)
                if healthy:
                    await self._scrape(http)
                if healthy != self.healthy:
                    self.healthy = healthy
                    await self.on_change(self)
            return exited.result()
        finally:
            self.healthy = False
            if not exited.done():
                exited.cancel()

    async def _probe(self, http: aiohttp.ClientSession) -> bool:
        try:
            async with http.get(f"{self.base_url}/health") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _scrape(self, http: aiohttp.ClientSession) -> None:
        try:
            async with http.get(f"{self.base_url}/metrics") as resp:
                if resp.status == 200:
                    self.load = parse_load(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            pass

    async def _terminate(self) -> None:
        proc = self.process
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), self.stop_grace_s)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    def _log_fields(self) -> dict[str, object]:
        return {"instance": self.engine.instance_id, "restarts": self.restarts, "exit_code": self.last_exit_code}
