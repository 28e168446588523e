"""Engine processes that outlive their agent: launch detached, record in the state directory, adopt, stop.

An engine takes minutes to load weights on Ascend; restarting or upgrading the agent must not restart it. So:

- engines are launched in a session of their own (`setsid`), not as parts of the agent's process group, with no
  parent-death signal: the agent exiting (SIGTERM, SIGKILL, a crash, `systemctl restart` with `KillMode=process`)
  leaves them serving;
- each launch writes a record `<state_dir>/<name>.json` (pid, the process's start time in clock ticks from
  `/proc/<pid>/stat`, argv, a digest of the launch environment, port, KV event endpoints);
- a new agent reads the record and adopts the process when the same pid still runs with the same start time (not
  a reused pid) and the same argv and environment (the config did not change); a recorded process whose launch
  changed is stopped (it holds the port) and launched again;
- an adopted process is watched through a pidfd (`pidfd_open`), which becomes readable when it exits, and signalled
  through it (`pidfd_send_signal`), so a pid reused after its exit is never signalled. Its exit code is unknown (it
  is not our child).

`stop_recorded()` stops every recorded process of a state directory without an agent: what
`tandem agent stop --engines` does when the agent is not running, and what `tandem up` sweeps at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import select
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.tls import CERTS_ENV

#: Suffix of record files in the state directory.
RECORD_SUFFIX = ".json"


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, field 22 of /proc/<pid>/stat); None when it is gone or a
    zombie. Together with the pid it names one process: a reused pid has another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces and parentheses
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def engine_base_env() -> dict[str, str]:
    """The agent's environment as an engine inherits it: without the certificate directory (`tandem.tls.CERTS_ENV`),
    which holds the agent's key; an engine needs only the CA bundle its launch environment names."""
    return {k: v for k, v in os.environ.items() if k != CERTS_ENV}


def env_digest(env: dict[str, str]) -> str:
    """A digest of the launch-specific environment (not the agent's own), to tell a changed launch."""
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(slots=True)
class ProcessRecord:
    """What the state directory keeps about one launched process."""

    name: str  # the supervisor's name (instance id, or `<id>-dp<rank>`)
    pid: int
    start_ticks: int  # /proc/<pid>/stat starttime: pid + start time identify the process
    argv: list[str]
    env_digest: str
    launched_at: float  # wall clock
    port: int | None = None  # the API server's port (for operators reading the file)
    kv_events: list[str] = field(default_factory=list)  # KV event endpoints (live, replay) it publishes on
    restarts: int = 0  # restarts before this launch, carried over to the adopting agent

    def alive(self) -> bool:
        """True while the recorded process (same pid, same start time) runs."""
        return start_ticks(self.pid) == self.start_ticks

    def same_launch(self, argv: list[str], env: dict[str, str]) -> bool:
        """True when the process was started with this argv and launch environment."""
        return self.argv == list(argv) and self.env_digest == env_digest(env)


def record_path(state_dir: str | Path, name: str) -> Path:
    return Path(state_dir) / f"{name}{RECORD_SUFFIX}"


def write_record(state_dir: str | Path, record: ProcessRecord) -> None:
    """Writes the record atomically (a reader never sees half a file)."""
    path = record_path(state_dir, record.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record), indent=1))
    os.replace(tmp, path)


def read_record(state_dir: str | Path, name: str) -> ProcessRecord | None:
    """The record of `name`, or None when there is none or it cannot be read (then it is ignored)."""
    path = record_path(state_dir, name)
    try:
        return ProcessRecord(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def remove_record(state_dir: str | Path, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        record_path(state_dir, name).unlink()


def read_records(state_dir: str | Path) -> list[ProcessRecord]:
    """Every readable record of the directory."""
    directory = Path(state_dir)
    if not directory.is_dir():
        return []
    records = [
        read_record(directory, p.name[: -len(RECORD_SUFFIX)]) for p in directory.glob(f"*{RECORD_SUFFIX}")
    ]
    return sorted((r for r in records if r is not None), key=lambda r: r.name)


class EngineProcess:
    """A running engine process, launched by this agent or adopted from a record; watched through a pidfd."""

    def __init__(self, pid: int, popen: subprocess.Popen | None = None) -> None:
        self.pid = pid
        self.adopted = popen is None  # not our child: exit code unknown
        self._popen = popen
        self._fd: int | None = os.pidfd_open(pid)  # ProcessLookupError when it is already gone
        self.exited = False
        self.returncode: int | None = None  # known only for our own children

    @classmethod
    def launch(cls, argv: list[str], env: dict[str, str], log_path: str) -> EngineProcess:
        """Starts `argv` in a session of its own (signals to the agent's process group do not reach it; it outlives
        the agent), output appended to `log_path`."""
        with open(log_path, "ab") as out:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env={**engine_base_env(), **env},
                start_new_session=True,
                close_fds=True,
            )
        return cls(popen.pid, popen)

    @property
    def running(self) -> bool:
        """False once the process has exited (as seen by `wait()` or a poll)."""
        if not self.exited and self._popen is not None and self._popen.poll() is not None:
            self._mark_exited()
        return not self.exited

    def _mark_exited(self) -> None:
        self.exited = True
        if self._popen is not None:
            self.returncode = self._popen.wait()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def wait(self) -> int | None:
        """Waits for the exit; returns the exit code (negative: killed by that signal), None for an adopted one."""
        if self.exited or self._fd is None:
            return self.returncode
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        fd = self._fd

        def readable() -> None:
            if not done.done():
                done.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await done
        finally:
            loop.remove_reader(fd)
        if not self.exited:
            self._mark_exited()
        return self.returncode

    def signal(self, signum: int) -> None:
        """Sends `signum` through the pidfd (never to a process that reused the pid); no-op once exited."""
        if self.exited or self._fd is None:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._fd, signum)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; returns once it has exited."""
        if not self.running:
            return
        self.terminate()
        try:
            async with asyncio.timeout(grace_s):
                await self.wait()
        except TimeoutError:
            self.kill()
            await self.wait()

    def detach(self) -> None:
        """Lets the process run on without this agent (closes the pidfd; the record stays)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.exited = True  # for this agent: no longer watched


def adopt(record: ProcessRecord) -> EngineProcess | None:
    """The recorded process, when it still runs; None otherwise."""
    if not record.alive():
        return None
    try:
        process = EngineProcess(record.pid)
    except ProcessLookupError:
        return None
    if not record.alive():  # exited (and maybe replaced) between the check and pidfd_open
        process.detach()
        return None
    return process


def stop_recorded(state_dir: str | Path, grace_s: float = 10.0) -> list[str]:
    """Stops every recorded process that still runs (SIGTERM, SIGKILL after `grace_s`) and removes the records;
    returns the names of the processes it stopped. For use without a running agent."""
    stopped: list[str] = []
    live: list[tuple[ProcessRecord, int]] = []
    for record in read_records(state_dir):
        if record.alive():
            try:
                fd = os.pidfd_open(record.pid)
            except ProcessLookupError:
                remove_record(state_dir, record.name)
                continue
            if record.alive():
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGTERM)
                live.append((record, fd))
                stopped.append(record.name)
            else:
                os.close(fd)
        remove_record(state_dir, record.name)
    deadline = time.monotonic() + grace_s
    for record, fd in live:
        # A pidfd polls readable once the process has exited.
        select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if record.alive():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        os.close(fd)
    return stopped
