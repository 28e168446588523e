"""The coordinator process as `coordinator.app.run` starts it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Runs a plain-text coordinator of a P/D mesh (no engines, no request) in a fresh interpreter and prints the name
#: of the thread that imported aiohttp, or null when nothing did within 30 s.
SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys, threading

    seen = {}

    class Spy:
        def find_spec(self, name, path=None, target=None):
            if name == "aiohttp" and not seen:
                seen["thread"] = threading.current_thread().name
            return None

    sys.meta_path.insert(0, Spy())
    from coordinator import app
    from mesh.config import parse_mesh_config
    from tests.helpers import mesh_config

    config = mesh_config(engines=1)
    config["node_agents"] = []
    config["coordinator"]["pd_mode"] = "prefill_handoff_decode"
    mesh = parse_mesh_config(config, "mesh.yaml")

    async def main():
        served = asyncio.create_task(app.run(mesh))
        for _ in range(600):
            if "aiohttp" in sys.modules and "thread" in seen:
                break
            await asyncio.sleep(0.05)
        print(json.dumps(seen.get("thread")), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        await served

    asyncio.run(main())
    """
)


def test_a_pd_coordinator_imports_its_http_client_off_the_event_loop_once_serving(monkeypatch):
    """The prefill legs' HTTP client (aiohttp, about a quarter of a second to import) is imported in a worker
    thread after start, without any request: imported on the first leg, it stalled every decision in flight."""
    monkeypatch.setenv("TANDEM_NO_BANNER", "1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    thread = json.loads(out.stdout.strip().splitlines()[-1])
    assert thread is not None, "aiohttp was not imported within 30 s of start"
    assert thread != "MainThread"
