"""`tandem top` driven in a real terminal (tmux, 200x50) as an operator runs it: `tandem top --config FILE
--certs-dir DIR` against a 4-engine mesh started by `tandem up` (mutual TLS: it reads Admin through Envoy with the
operator's certificate) while clients send shared-prefix requests: every instance's id, health, load and hit rate is
on screen, and a recent kv_affinity decision with the chosen engine's expected cache hit and predicted TTFT; an
engine SIGKILLed shows not HEALTHY within 2 s, then HEALTHY again with a short UP once its agent restarted it (after
4 s here: the tests' usual 0.2 s backoff and a 0.5 s simulated start-up would bring it back between two refreshes,
shown only by UP). Bounded: 2 clients for at most 60 s, each request with
a 30 s timeout; every wait has its deadline."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.helpers import ROOT, RunningMesh, mesh_config, wait_until

TMUX = shutil.which("tmux")
ENGINES = [f"sim-{i}" for i in range(4)]
VICTIM = "sim-2"
RESTART_AFTER_S = 4.0

pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux not installed (make system-deps)")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    config = mesh_config(engines=4, engine_args=["--speedup", "20"], policy="kv_affinity")
    config["node_agents"][0]["restart"] = {
        "initial_backoff_s": RESTART_AFTER_S,
        "max_backoff_s": RESTART_AFTER_S,
    }
    running = RunningMesh(config, tmp_path_factory.mktemp("top"))
    running.start()
    yield running
    running.stop()


class Terminal:
    """A tmux server of our own (its socket in the test's directory) with one 200x50 window running `command`."""

    def __init__(self, socket, command: list[str]) -> None:
        self.socket = str(socket)
        self.tmux([
            "new-session", "-d", "-x", "200", "-y", "50", "-s", "top", "-c", str(ROOT),
            " ".join(map(shlex_quote, command)),
        ])  # fmt: skip
        # Keep the window 200x50 whatever clients come and go (tmux sizes windows to its clients by default).
        self.tmux(["set-option", "-t", "top", "window-size", "manual"])
        self.tmux(["resize-window", "-t", "top", "-x", "200", "-y", "50"])

    def tmux(self, args: list[str]) -> str:
        out = subprocess.run([TMUX, "-S", self.socket, *args], capture_output=True, text=True, timeout=10)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def screen(self) -> str:
        return self.tmux(["capture-pane", "-p", "-t", "top"])

    def close(self) -> None:
        subprocess.run([TMUX, "-S", self.socket, "kill-server"], capture_output=True, timeout=10)


def shlex_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def row(screen: str, instance_id: str) -> str:
    return next((line for line in screen.splitlines() if re.search(rf"\b{instance_id}\b", line)), "")


def cells(screen: str, instance_id: str) -> list[str]:
    """The instance's row split into its columns (INSTANCE, MODEL, ROLE, NODE, HEALTH, ..., HEARTBEAT, UP)."""
    return [c.strip() for c in row(screen, instance_id).split("│")[1:-1]]


#: A row of the recent decisions panel: time, request id, model, policy, stage, chosen engine, prompt tokens, then
#: the chosen engine's score components: expected hit tokens (> 0: the shared prefix), queued prefill, predicted TTFT.
DECISION_ROW = re.compile(
    r"\d\d:\d\d:\d\d\s*│\s*tdm-[0-9a-f]{24}\s*│\s*tandem-sim\s*│\s*kv_affinity\s*│\s*aggregated\s*│\s*(sim-\d)\s*│"
    r"\s*\d+\s*│\s*([1-9]\d*)\s*│\s*\d+\s*│\s*(\d+ms|\d+\.\d\ds)\s*│"
)


def test_top_shows_the_mesh_under_load_and_a_killed_engine_turning_unhealthy(mesh, tmp_path):
    stop = threading.Event()

    def client(k: int) -> None:
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=mesh.http, timeout=30) as http:
            i = 0
            while not stop.is_set() and time.monotonic() < deadline:
                prompt = (
                    f"Shared system prompt {i % 4}: " + " ".join(f"rule{j}" for j in range(40)) + f" q{k}-{i}"
                )
                body = {"model": "tandem-sim", "prompt": prompt, "max_tokens": 16, "stream": True}
                try:
                    with http.stream("POST", "/v1/completions", json=body) as reply:
                        reply.read()
                except httpx.HTTPError:
                    pass  # the killed engine's streams
                i += 1

    clients = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(2)]
    for t in clients:
        t.start()
    # The console size is pinned: under pytest, rich read 80 columns in tmux's 200-column pane (not understood).
    command = [
        "env", "COLUMNS=200", "LINES=50", sys.executable, "-m", "mesh", "top", "--config", str(mesh.config_path), "--certs-dir", str(mesh.certs),
    ]  # fmt: skip
    terminal = Terminal(tmp_path / "tmux.sock", command)
    try:

        def everything_shown() -> bool:
            screen = terminal.screen()
            rows = [row(screen, iid) for iid in ENGINES]
            return (
                all("HEALTHY" in r for r in rows)
                and any(re.search(r"\b[1-9]\d*%", r) for r in rows)  # a hit rate
                and "policy kv_affinity" in screen
                and "service tiers" in screen
                and DECISION_ROW.search(screen) is not None
            )

        try:
            wait_until(
                everything_shown,
                30,
                "tandem top to show every instance healthy with a hit rate, and a scored decision",
            )
        except Exception:
            print(terminal.screen(), terminal.tmux(["list-windows"]))
            raise
        screen = terminal.screen()
        print(screen)
        for header in (
            "INSTANCE",
            "HEALTH",
            "RUN",
            "WAIT",
            "INFLIGHT",
            "QUEUED PREFILL",
            "HIT 10s",
            "ATTAINMENT",
            "recent decisions",
            "PRED TTFT",
        ):
            assert header in screen, header
        decided = DECISION_ROW.search(screen)
        assert decided is not None and decided.group(1) in ENGINES
        print(
            f"a decision row: chosen {decided.group(1)}, hit {decided.group(2)} tok, predicted TTFT {decided.group(3)}"
        )

        victim = mesh.engines()[VICTIM].pid
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: "HEALTHY" not in row(terminal.screen(), VICTIM).replace("UNHEALTHY", ""), 2.0,
                   f"{VICTIM} shown not healthy")  # fmt: skip
        shown = time.monotonic() - killed
        print(f"{VICTIM} shown as {cells(terminal.screen(), VICTIM)[4]} {shown:.2f}s after SIGKILL")
        print(terminal.screen())
        assert all("HEALTHY" in row(terminal.screen(), iid) for iid in ENGINES if iid != VICTIM)

        def back() -> bool:
            row_cells = cells(terminal.screen(), VICTIM)
            return (
                len(row_cells) > 14
                and row_cells[4] == "HEALTHY"
                and row_cells[14] in {f"{s}s" for s in range(10)}
            )

        wait_until(back, RESTART_AFTER_S + 20, f"{VICTIM} restarted, shown HEALTHY with a short UP")
        print(
            f"{VICTIM} back {time.monotonic() - killed:.1f}s after SIGKILL: {row(terminal.screen(), VICTIM)}"
        )
    finally:
        stop.set()
        terminal.close()
        for t in clients:
            t.join(35)
