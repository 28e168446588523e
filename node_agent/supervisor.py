"""Supervision of one process (an engine API server or rank, or the KV store): launch, health, load scraping,
restart with backoff, drain, stop.

State machine: STARTING -> RUNNING -> (exit) BACKOFF -> STARTING ... -> FAILED after a crash loop;
RUNNING -> DRAINING -> STOPPED on `drain()`; STOPPED on request. Every transition is reported through `on_change`.

Health: HTTP `/health` for a process with a port (answered within `probe_timeout_s`, so a hung engine is
unhealthy after at most one probe interval plus that timeout); a TCP connect for a store with a health address; the
process being alive for a headless rank.

Processes outlive the agent (`node_agent.processes`): every launch is recorded in the state directory, and a
supervisor started by a new agent adopts the recorded process instead of launching another when it still runs with
the same launch. `stop()` stops the process; `detach()` (agent restart) leaves it running.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from node_agent.adapters import EngineAdapters, Outcome, Result
from node_agent.backends import Backend, get_backend
from node_agent.config import EngineConfig, NodeAgentConfig, RestartPolicy
from node_agent.launch import LaunchSpec
from node_agent.processes import (
    EngineProcess,
    ProcessRecord,
    adopt,
    env_digest,
    read_record,
    remove_record,
    start_ticks,
    write_record,
)
from tandem.engine_load import EngineLoad
from tandem.netaddr import join_host_port, split_host_port
from tandem.restarts import RestartState, RestartTracker

log = logging.getLogger(__name__)
#: How often a LoRA engine's `/v1/models` is read again (adapters loaded or unloaded by others show up).
ADAPTERS_REFRESH_S = 5.0


class EngineState(enum.Enum):
    """Mirrors `tandem.v1.EngineState`."""

    STARTING = 1
    RUNNING = 2
    BACKOFF = 3
    STOPPED = 4
    FAILED = 5
    DRAINING = 6
    UNRESPONSIVE = 7  # only reported (`reported_state`): RUNNING while its health probe fails


@dataclass(slots=True)
class DrainResult:
    """How a drain ended."""

    drained: bool  # True when no request was left in flight; False on timeout
    in_flight: int  # requests running + waiting at the end
    waited_s: float


@dataclass(frozen=True, slots=True)
class SupervisorParams:
    """How a node supervises its processes: one value, from the node's config, shared by its supervisors."""

    restart: RestartPolicy  # backoff and crash-loop limit
    log_dir: str  # each process logs to `<log_dir>/<name>.log`
    probe_interval_s: float  # how often health is probed
    stop_grace_s: float  # SIGTERM to SIGKILL when stopping
    load_interval_s: float | None = None  # how often `/metrics` is scraped; `probe_interval_s` when None
    idle_load_interval_s: float | None = None  # how often while it is idle; `load_interval_s` when None
    idle_probe_interval_s: float | None = None  # how often while it is idle; `probe_interval_s` when None
    probe_timeout_s: float = 1.0  # a health probe (or scrape) that takes longer fails
    state_dir: str | None = None  # where launches are recorded for a later agent to adopt; None: not recorded
    liveness_timeout_s: float | None = (
        None  # no answered probe for this long: killed and restarted; None: never
    )

    @classmethod
    def from_config(cls, config: NodeAgentConfig, runtime_dir: str) -> SupervisorParams:
        """The node's supervision settings, logs in `runtime_dir`."""
        return cls(
            restart=config.restart,
            log_dir=runtime_dir,
            probe_interval_s=config.probe_interval_s,
            idle_probe_interval_s=config.idle_probe_interval_s,
            stop_grace_s=config.stop_grace_s,
            load_interval_s=config.load_interval_s,
            idle_load_interval_s=config.idle_load_interval_s,
            probe_timeout_s=config.probe_timeout_s,
            state_dir=config.state_path,
            liveness_timeout_s=config.liveness_timeout_s,
        )


class EngineSupervisor:
    """Runs and watches one process until `stop()`."""

    def __init__(
        self,
        engine: EngineConfig | None,
        spec: LaunchSpec,
        params: SupervisorParams,
        on_change: Callable[[EngineSupervisor], Awaitable[None]],
        health_timeout_s: float | None = None,
        tcp_health: str | None = None,
    ) -> None:
        self.engine = engine  # None for a service that is not an engine (the KV store)
        # Where its readiness and load are read; None for the KV store.
        self.backend: Backend | None = get_backend(engine.backend) if engine else None
        self.spec = spec
        self.name = spec.name
        self.health_timeout_s = health_timeout_s or (engine.health_timeout_s if engine else 60.0)
        self.tcp_health = tcp_health  # host:port that accepts connections once the process is up
        self.tracker = RestartTracker(params.restart)  # crashes in a row, backoff, restarts so far
        self.log_path = os.path.join(params.log_dir, f"{spec.name}.log")
        self.probe_interval_s = params.probe_interval_s
        self.load_interval_s = (
            params.load_interval_s or params.probe_interval_s
        )  # how often `/metrics` is read
        # Read and probe idle engines less often only where their KV events say when work begins (`activity`).
        relayed = bool(spec.kv_events)
        idle_load, idle_probe = (
            (params.idle_load_interval_s, params.idle_probe_interval_s) if relayed else (None, None)
        )
        self.idle_load_interval_s = idle_load or self.load_interval_s
        self.idle_probe_interval_s = idle_probe or self.probe_interval_s
        self.on_load: Callable[[EngineSupervisor], None] | None = None  # after a scrape that found news
        self.scrapes = 0  # successful `/metrics` reads since the agent started
        self.probes = 0  # health probes since the agent started
        self.idle = (
            False  # the last read found the engine idle (`engine_idle`): read every idle_load_interval_s
        )
        self._wake: asyncio.Event | None = None  # set by `activity` to read an idle engine at once
        self._answered_at = 0.0  # loop time of the last answered health probe
        self._failed = 0  # health probes failed in a row since then
        self.probe_timeout_s = params.probe_timeout_s
        self.liveness_timeout_s = params.liveness_timeout_s
        self.state_dir = params.state_dir
        self.stop_grace_s = params.stop_grace_s
        self.on_change = on_change
        self.state = EngineState.STOPPED
        self.detail = ""
        self.healthy = False
        self.load = EngineLoad()
        self.last_exit_code: int | None = None
        self.started_wall = 0.0  # wall clock, for status
        self.process: EngineProcess | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._replaced: EngineProcess | None = None  # a recorded process to stop before launching
        self._kill_reason: str | None = (
            None  # why supervision killed the process (liveness), for its exit detail
        )
        #: The LoRA adapters the engine serves, from its `/v1/models` (empty without LoRA or when not running).
        self.adapters: list[str] = []
        #: Configured adapters the engine refused at its last start, with the engine's message.
        self.adapter_errors: dict[str, str] = {}
        self._adapters_task: asyncio.Task | None = None

    @property
    def restarts(self) -> int:
        """Restarts so far (carried over from the agent that launched an adopted process)."""
        return self.tracker.restarts

    @property
    def base_url(self) -> str:
        """The engine's HTTP root (empty for a process without an API server)."""
        if self.engine is None or self.spec.port is None:
            return ""
        return f"http://{join_host_port(self.engine.host, self.spec.port)}"

    @property
    def registrable(self) -> bool:
        """True for an engine API server, which the coordinator routes to."""
        return self.engine is not None and self.spec.port is not None

    @property
    def reported_state(self) -> EngineState:
        """The state operators see: UNRESPONSIVE for a RUNNING process that fails its health probe (hung or frozen;
        not routed), else `state`. Supervision itself keeps it RUNNING: registration and KV event relay stay."""
        if self.state is EngineState.RUNNING and not self.healthy:
            return EngineState.UNRESPONSIVE
        return self.state

    @property
    def in_flight(self) -> int:
        """Requests running or waiting in the engine, from the last `/metrics` scrape."""
        return self.load.running + self.load.waiting

    @property
    def running(self) -> bool:
        """True while the supervised process runs."""
        return self.process is not None and self.process.running

    @property
    def adopted(self) -> bool:
        """True when the running process was launched by an earlier agent and adopted by this one."""
        return self.running and self.process is not None and self.process.adopted

    def start(self, adopt: bool = False) -> None:
        """Starts supervising: adopts the recorded process when `adopt` and it still runs with this launch, else
        launches the engine; a no-op while already supervised."""
        if self._task is None or self._task.done():
            self._stopping = False
            self.tracker.reset()
            adopted = self._adopt() if adopt else None
            self._task = asyncio.create_task(self._supervise(adopted), name=f"engine-{self.name}")

    def _adopt(self) -> EngineProcess | None:
        """The process an earlier agent launched for this supervisor, when it still runs with the same launch. A
        recorded process with another launch (the config changed) is stopped: it holds the port."""
        if self.state_dir is None:
            return None
        record = read_record(self.state_dir, self.name)
        if record is None:
            return None
        process = adopt(record)
        if process is None:
            remove_record(self.state_dir, self.name)
            return None
        if not record.same_launch(self.spec.argv, self.spec.env):
            log.warning(
                "recorded process has another launch, replacing it",
                extra={"pid": record.pid, **self._log_fields()},
            )
            self._replaced = process
            return None
        self.tracker.restarts = record.restarts
        self.started_wall = record.launched_at
        log.info("adopted running process", extra={**self._log_fields(), "pid": record.pid})
        return process

    async def stop(self, detail: str = "stopped on request") -> None:
        """Stops the engine (SIGTERM, SIGKILL after the grace period) and supervision."""
        self._stopping = True
        await self._terminate()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.state_dir is not None:
            remove_record(self.state_dir, self.name)
        await self._set(EngineState.STOPPED, detail)

    async def detach(self) -> None:
        """Ends supervision and leaves the process running, recorded for the next agent to adopt."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.process is not None:
            self.process.detach()

    async def drain(self, timeout_s: float, settle_s: float = 0.5) -> DrainResult:
        """Takes no new requests (DRAINING: `on_change` deregisters it), waits until the engine's
        `vllm:num_requests_running` + `vllm:num_requests_waiting` reach zero on two reads `settle_s` apart (a request
        routed just before the deregistration may still be on its way), or `timeout_s`, then stops the engine."""
        started = time.monotonic()
        if self.state is not EngineState.RUNNING:
            await self.stop(f"drain: was {self.state.name.lower()}, stopped")
            return DrainResult(True, 0, 0.0)
        self._stopping = True  # an exit while draining is final, not restarted
        await self._set(
            EngineState.DRAINING, f"draining, waiting up to {timeout_s:g}s for requests in flight"
        )
        zero_since: float | None = None
        in_flight = self.in_flight
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while time.monotonic() - started < timeout_s:
                if not self.running:
                    in_flight = 0
                    break
                await self._scrape(http)
                in_flight = self.in_flight
                now = time.monotonic()
                if in_flight == 0:
                    zero_since = now if zero_since is None else zero_since
                    if now - zero_since >= settle_s:
                        break
                else:
                    zero_since = None
                await asyncio.sleep(min(0.2, settle_s / 2))
        waited = time.monotonic() - started
        drained = in_flight == 0
        detail = (
            f"drained in {waited:.1f}s, stopped"
            if drained
            else f"drain timed out after {waited:.1f}s with {in_flight} request(s) in flight, stopped"
        )
        log.info("engine drained", extra={**self._log_fields(), "drained": drained, "in_flight": in_flight})
        await self.stop(detail)
        return DrainResult(drained, in_flight, waited)

    async def _set(self, state: EngineState, detail: str = "") -> None:
        changed = state != self.state or detail != self.detail
        self.state, self.detail = state, detail
        if state is not EngineState.RUNNING:
            self.healthy = False
        if changed:
            await self.on_change(self)

    async def _supervise(self, adopted: EngineProcess | None) -> None:
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            replaced, self._replaced = self._replaced, None
            if replaced is not None:
                await replaced.stop(self.stop_grace_s)
            while not self._stopping:
                code = await self._run_once(http, adopted)
                adopted = None
                if self._stopping:
                    return
                if self.state_dir is not None:
                    remove_record(self.state_dir, self.name)
                self.last_exit_code = code
                delay = self.tracker.exited(time.monotonic())
                if self.tracker.state is RestartState.FAILED:  # the agent gives up (`tandem up` would retry)
                    await self._set(
                        EngineState.FAILED,
                        f"exited with code {code}; {self.tracker.quick_exits} failures in a row, not restarting "
                        f"(log: {self.log_path})",
                    )
                    log.error("engine crash loop, giving up", extra=self._log_fields())
                    return
                how = (
                    f"exited with code {code}" if code is not None else "exited (adopted: exit code unknown)"
                )
                if self._kill_reason:
                    how, self._kill_reason = f"{self._kill_reason}; {how}", None
                await self._set(EngineState.BACKOFF, f"{how}, restart in {delay:g}s")
                log.warning("engine exited, restarting", extra={**self._log_fields(), "delay_s": delay})
                await asyncio.sleep(delay)
                self.tracker.restarts += 1

    def _launch(self) -> EngineProcess:
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        process = EngineProcess.launch(self.spec.argv, self.spec.env, self.log_path)
        self.started_wall = time.time()
        ticks = start_ticks(process.pid)
        if self.state_dir is not None and ticks is not None:
            endpoints = [e for s in self.spec.kv_events for e in (s.endpoint, s.replay_endpoint) if e]
            write_record(
                self.state_dir,
                ProcessRecord(
                    name=self.name,
                    pid=process.pid,
                    start_ticks=ticks,
                    argv=list(self.spec.argv),
                    env_digest=env_digest(self.spec.env),
                    launched_at=self.started_wall,
                    port=self.spec.port,
                    kv_events=endpoints,
                    restarts=self.restarts,
                ),
            )
        log.info("engine launched", extra={**self._log_fields(), "pid": process.pid})
        return process

    async def _run_once(
        self, http: aiohttp.ClientSession, adopted: EngineProcess | None = None
    ) -> int | None:
        """Launches (or takes over `adopted`), waits for health, then watches until the process exits; returns its
        exit code (None for an adopted process)."""
        await self._set(EngineState.STARTING, "waiting for /health" + (" (adopted)" if adopted else ""))
        self.process = adopted or self._launch()
        self.tracker.started(time.monotonic())
        exited = asyncio.create_task(self.process.wait())
        try:
            deadline = time.monotonic() + self.health_timeout_s
            while not await self._probe(http):
                if exited.done():
                    return exited.result()
                if time.monotonic() > deadline:
                    self.detail = f"not healthy after {self.health_timeout_s:g}s"
                    await self._terminate()
                    return await exited
                await asyncio.sleep(0.1)
            self.healthy = True
            await self._set(EngineState.RUNNING)
            if self.lora_engine:  # loads and watches its adapters beside health and load
                self._adapters_task = asyncio.create_task(self._watch_adapters(http))
            await self._watch(http, exited)
            return exited.result()
        finally:
            self.healthy = False
            self.adapters = []
            if self._adapters_task is not None:
                self._adapters_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._adapters_task
                self._adapters_task = None
            if not exited.done():
                exited.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await exited  # its pidfd reader is removed before anything closes the pidfd

    async def _watch(self, http: aiohttp.ClientSession, exited: asyncio.Future) -> None:
        """Until the process exits: probes its health every `probe_interval_s` (every `idle_probe_interval_s` while
        it is idle and healthy), and reads its load every `load_interval_s` while it works, every
        `idle_load_interval_s` while idle, and at once when an idle engine publishes KV events (`activity`)."""
        loop = asyncio.get_running_loop()
        probed_at = loop.time()
        next_probe = probed_at + self.probe_interval_s
        next_scrape = loop.time() if self.base_url else math.inf
        scraped_at = -math.inf
        self._answered_at, self._failed = loop.time(), 0
        self._wake = wake = asyncio.Event()
        woken = asyncio.ensure_future(wake.wait())
        try:
            while not exited.done():
                timeout = max(0.0, min(next_probe, next_scrape) - loop.time())
                await asyncio.wait({exited, woken}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if exited.done():
                    return
                if woken.done():
                    wake.clear()
                    woken = asyncio.ensure_future(wake.wait())
                    next_scrape = min(next_scrape, scraped_at + self.load_interval_s)
                    next_probe = min(next_probe, probed_at + self.probe_interval_s)
                if loop.time() >= next_probe - TIMER_SLACK_S:
                    probed_at = loop.time()
                    next_probe = probed_at + self.probe_interval_s
                    if not await self._check_health(http):
                        continue  # killed: `exited` follows
                    next_probe = probed_at + self._probe_interval()
                if loop.time() >= next_scrape - TIMER_SLACK_S:
                    scraped_at = loop.time()
                    if self.healthy and await self._scrape(http) and self.on_load is not None:
                        self.on_load(self)
                    interval = self.idle_load_interval_s if self.idle else self.load_interval_s
                    next_scrape = scraped_at + interval
                    next_probe = min(next_probe, probed_at + self._probe_interval())  # at work: probed often
        finally:
            woken.cancel()
            self._wake = None

    def _probe_interval(self) -> float:
        """Seconds from one health probe to the next: `idle_probe_interval_s` while the engine is idle and healthy."""
        return self.idle_probe_interval_s if self.idle and self.healthy else self.probe_interval_s

    async def _check_health(self, http: aiohttp.ClientSession) -> bool:
        """One health probe: reports a change of health, and kills a process silent past `liveness_timeout_s`
        (returns False then)."""
        now = asyncio.get_running_loop().time
        self.probes += 1
        healthy = await self._probe(http)
        self._failed = 0 if healthy else self._failed + 1
        if healthy:
            self._answered_at = now()
        elif liveness_expired(self._answered_at, now(), self._failed, self.liveness_timeout_s):
            silent = now() - self._answered_at
            self._kill_reason = (
                f"no answer to its health probe for {silent:.1f}s, killed (liveness_timeout_s)"
            )
            self.detail = self._kill_reason
            log.error("engine unresponsive, killing it", extra={**self._log_fields(), "silent_s": silent})
            assert self.process is not None
            self.process.kill()  # SIGKILL: a stopped (SIGSTOP) or wedged process takes nothing else
            return False
        if healthy != self.healthy:
            self.healthy = healthy
            self.detail = "" if healthy else f"not answering {self._health_what()} (unresponsive)"
            log.warning(
                "engine answers its health probe again" if healthy else "engine unresponsive",
                extra=self._log_fields(),
            )
            await self.on_change(self)
        return True

    @property
    def lora_engine(self) -> bool:
        """An engine with an API server launched with LoRA."""
        return self.engine is not None and self.engine.lora_enabled and bool(self.base_url)

    async def _watch_adapters(self, http: aiohttp.ClientSession) -> None:
        """Loads the configured adapters but those with `preload: false` (one the engine refuses is logged with its
        message and skipped: the engine serves the others), then keeps `adapters` in step with the engine's `/v1/models`."""
        assert self.engine is not None
        client = EngineAdapters(self.base_url)
        errors: dict[str, str] = {}
        for adapter in self.engine.adapters:
            if not adapter.preload:  # loaded on demand, where the coordinator sends its requests
                continue
            result = await client.load(http, adapter.name, adapter.path)
            if result.outcome in (Outcome.OK, Outcome.ALREADY_LOADED):  # loaded before: an adopted engine
                continue
            errors[adapter.name] = result.message
            log.error(
                "LoRA adapter not loaded; the engine serves the others",
                extra={
                    **self._log_fields(),
                    "adapter": adapter.name,
                    "path": adapter.path,
                    "error": result.message,
                },
            )
        self.adapter_errors = errors
        while True:
            listed = await client.listed(http)
            if listed is not None and listed != self.adapters:
                self.adapters = listed
                if self.on_load is not None:
                    self.on_load(self)
            await asyncio.sleep(ADAPTERS_REFRESH_S)

    async def load_adapter(self, name: str, path: str, load_inplace: bool = False) -> Result:
        """Loads an adapter into the running engine (`NodeAgent.LoadAdapter`); reports the new list at once."""
        return await self._adapter_call(lambda c, h: c.load(h, name, path, load_inplace))

    async def unload_adapter(self, name: str) -> Result:
        """Unloads an adapter from the running engine (`NodeAgent.UnloadAdapter`)."""
        return await self._adapter_call(lambda c, h: c.unload(h, name))

    async def _adapter_call(self, call) -> Result:
        if not self.healthy:
            return Result(Outcome.UNAVAILABLE, f"engine {self.name!r} is {self.reported_state.name.lower()}")
        client = EngineAdapters(self.base_url)
        async with aiohttp.ClientSession() as http:
            result = await call(client, http)
            listed = await client.listed(http)
        if listed is not None:
            self.adapters = listed
            if self.on_load is not None:
                self.on_load(self)
        return result

    async def _probe(self, http: aiohttp.ClientSession) -> bool:
        if self.tcp_health is not None:
            return await _tcp_open(self.tcp_health)
        # A headless rank, or a store without a health address: alive is healthy.
        if self.backend is None or not self.base_url:
            return self.running
        try:
            async with http.get(f"{self.base_url}{self.backend.health_path}") as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    def _health_what(self) -> str:
        if self.tcp_health is not None:
            return f"a connection to {self.tcp_health} within 1s"
        return f"/health within {self.probe_timeout_s:g}s"

    def activity(self) -> None:
        """The engine published KV events: an idle one has begun to work, so it is read now, not at the end of
        `idle_load_interval_s`."""
        if self.idle and self._wake is not None:
            self._wake.set()

    async def _scrape(self, http: aiohttp.ClientSession) -> bool:
        """Reads the engine's load and progress counters; True when they are news for the coordinator (the load
        changed, or the engine works), False when unchanged or unread."""
        if self.backend is None:
            return False
        try:
            async with http.get(f"{self.base_url}/metrics") as resp:
                if resp.status != 200:
                    return False
                load = self.backend.read_load(await resp.text())
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return False
        previous, self.load = self.load, load
        self.scrapes += 1
        self.idle = engine_idle(previous, load)
        return not (self.idle and same_load(previous, load))

    async def _terminate(self) -> None:
        if self.process is not None:
            await self.process.stop(self.stop_grace_s)

    def _log_fields(self) -> dict[str, object]:
        return {"instance": self.name, "restarts": self.restarts, "exit_code": self.last_exit_code}


#: A probe or scrape due within this much is taken now (a timer may fire a hair early).
TIMER_SLACK_S = 0.005


def engine_idle(previous: EngineLoad, current: EngineLoad) -> bool:
    """True when an engine has nothing running or waiting and its progress counters have not moved since the
    previous read: nothing for the coordinator to follow until it works again."""
    return not current.running and not current.waiting and current.progress == previous.progress


def same_load(a: EngineLoad, b: EngineLoad) -> bool:
    """The two reads say the same, whenever they were taken."""
    return dataclasses.replace(a, sampled_at=0.0) == dataclasses.replace(b, sampled_at=0.0)


#: Health probes that must fail in a row before a silent engine is killed: one is not enough, as the first probe after
#: the agent itself was frozen or starved fails on its own account (a keep-alive connection the engine closed
#: meanwhile, a timeout run out while the agent did not run) and finds the engine silent since before the agent's gap.
LIVENESS_FAILED_PROBES = 2


def liveness_expired(answered_at: float, now: float, failed_probes: int, timeout_s: float | None) -> bool:
    """True when a running process whose last answered health probe was at `answered_at` has been silent for
    `timeout_s` (never with None) and failed `LIVENESS_FAILED_PROBES` probes in a row: it is frozen or hung, not busy
    (a busy engine still answers `/health`), and the silence is not only the agent's own."""
    return (
        timeout_s is not None and now - answered_at >= timeout_s and failed_probes >= LIVENESS_FAILED_PROBES
    )


async def _tcp_open(address: str) -> bool:
    host, port = split_host_port(address)
    try:
        async with asyncio.timeout(1.0):
            _, writer = await asyncio.open_connection(host, port)
    except (TimeoutError, OSError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True
