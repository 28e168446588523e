"""Steady streaming load for fault tests: N clients, each sending one streaming completion after another.

Every request is recorded with its start and end (monotonic) and outcome: ok means HTTP 200 and an SSE stream that
ended with `[DONE]` and no error event. A fault window is then judged by what started or ended inside it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass(slots=True)
class Outcome:
    """One request."""

    client: int
    started: float
    ended: float
    ok: bool
    status: int  # HTTP status; 0 when no response arrived
    error: str = ""  # why it failed


@dataclass
class LoadReport:
    """What a window of the load did."""

    sent: int
    ok: int
    failed: int
    errors: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"sent {self.sent}, ok {self.ok}, failed {self.failed}"


class SteadyLoad:
    """`clients` threads streaming completions to `base_url` until `stop()`."""

    def __init__(
        self, base_url: str, model: str, clients: int = 4, max_tokens: int = 24, timeout_s: float = 60
    ):
        self.base_url = base_url
        self.model = model
        self.clients = clients
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self._running: dict[int, float] = {}  # client -> when its request in progress started
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> SteadyLoad:
        for i in range(self.clients):
            thread = threading.Thread(target=self._client, args=(i,), daemon=True, name=f"load-{i}")
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 5)

    def count(self, ok: bool | None = None, since: float = 0.0) -> int:
        with self._lock:
            return sum(1 for o in self.outcomes if o.ended >= since and (ok is None or o.ok == ok))

    def running_since(self) -> list[float]:
        """When each request now in progress started (a request that hangs stays here)."""
        with self._lock:
            return sorted(self._running.values())

    def report(self, start: float = 0.0, end: float = float("inf")) -> LoadReport:
        """Requests that ended in [start, end)."""
        with self._lock:
            window = [o for o in self.outcomes if start <= o.ended < end]
        failed = [o for o in window if not o.ok]
        return LoadReport(len(window), len(window) - len(failed), len(failed), [o.error for o in failed])

    def _client(self, index: int) -> None:
        n = 0
        with httpx.Client(timeout=self.timeout_s) as http:
            while not self._stop.is_set():
                n += 1
                # A prompt per client and request: no two requests share a cache entry by accident.
                body = {
                    "model": self.model,
                    "prompt": f"client {index} request {n}: tell me about service meshes",
                    "max_tokens": self.max_tokens,
                    "stream": True,
                }
                started = time.monotonic()
                with self._lock:
                    self._running[index] = started
                ok, status, error = self._one(http, body)
                with self._lock:
                    del self._running[index]
                    self.outcomes.append(Outcome(index, started, time.monotonic(), ok, status, error))
                if not ok:
                    self._stop.wait(0.1)  # a client that failed waits a little before its next request

    def _one(self, http: httpx.Client, body: dict) -> tuple[bool, int, str]:
        try:
            with http.stream("POST", f"{self.base_url}/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    return False, resp.status_code, f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                done = False
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        if data == "[DONE]":
                            done = True
                        elif '"error"' in data:
                            return False, 200, f"error event: {data[:200]}"
                return done, 200, "" if done else "stream ended without [DONE]"
        except httpx.HTTPError as exc:
            return False, 0, f"{type(exc).__name__}: {exc}"
