"""The shipped rules and dashboard against a real Prometheus (Debian's `prometheus` 2.42) scraping a running mesh
(`tandem up`, mutual TLS on the control plane; the metrics listeners are plain HTTP on loopback, scraped as an
operator's Prometheus would, with the configuration `tandem prometheus-config` prints).

The mesh serves a mix that gives every dashboard panel something to show: an aggregated model (`tandem-sim`: two
engines, kv_affinity, prompts sharing family prefixes, streamed, default tier) of which ONE ENGINE IS
MIS-CONFIGURED (`--block-size 128` while the mesh file says 16: the agent and the conductor index 16-token blocks
the engine never caches), a P/D handoff model (`tandem-pd`: one prefill and one decode engine), and `flex`-tier
requests whose SLO no busy engine meets, so the admission queue holds and sheds them (429).

Checked: `TandemPredictedHitsNotDelivered` fires for the mis-configured engine, and only for it, within a minute
of the load's start (the test's Prometheus scrapes and evaluates every second; the shipped rule keeps its 5-minute
rate and `for: 30s`); then every dashboard query returns series. Bounded: the load runs at most 90 s and 4
clients, each request with a 30 s timeout; the alert is awaited 60 s."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml

from mesh.config import parse_mesh_config
from mesh.observability import scrape_config
from tests.helpers import ROOT, RunningMesh, TimedOut, free_port, mesh_config, wait_until

PROMETHEUS = shutil.which("prometheus")
OBSERVABILITY = ROOT / "deploy" / "observability"
DASHBOARD = OBSERVABILITY / "tandem-dashboard.json"
MISCONFIGURED = "sim-1"
ALERT_WITHIN_S = 60.0
LOAD_LIMIT_S = 90.0

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not installed (make system-deps: apt-get install -y prometheus)"
)


def family_prompt(i: int) -> str:
    """~95 tokens shared by one family of eight, then ~65 of the request's own (over 128 in all)."""
    family = i % 8
    prefix = f"Family {family} system prompt: " + " ".join(f"w{family}x{j}" for j in range(16))
    return prefix + f" Question {i}: " + " ".join(f"q{i}y{j}" for j in range(10))


class Load:
    """Clients sending the mix until stopped (or `LOAD_LIMIT_S`)."""

    def __init__(self, mesh: RunningMesh) -> None:
        self.mesh = mesh
        self.stopped = threading.Event()
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(4)]

    def _client(self, k: int) -> None:
        with httpx.Client(base_url=self.mesh.http, timeout=30) as client:
            i = k
            while not self.stopped.is_set() and time.monotonic() - self.started < LOAD_LIMIT_S:
                if k == 3:  # P/D, and a flex request the busy engines cannot serve within its SLO
                    body = {"model": "tandem-pd", "prompt": family_prompt(i), "max_tokens": 4}
                    self.statuses.append(client.post("/v1/completions", json=body).status_code)
                    body = {
                        "model": "tandem-sim",
                        "prompt": f"flex {i}",
                        "max_tokens": 4,
                        "service_tier": "flex",
                    }
                    self.statuses.append(client.post("/v1/completions", json=body).status_code)
                else:
                    body = {
                        "model": "tandem-sim",
                        "prompt": family_prompt(i),
                        "max_tokens": 8,
                        "stream": True,
                    }
                    with client.stream("POST", "/v1/completions", json=body) as reply:
                        reply.read()
                        self.statuses.append(reply.status_code)
                i += 4

    def start(self) -> Load:
        self.started, self.started_wall = time.monotonic(), time.time()
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(35)


class Prometheus:
    """A real Prometheus scraping `mesh` every second and evaluating the shipped rules every second."""

    def __init__(self, mesh: RunningMesh, workdir: Path) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        config = scrape_config(
            parse_mesh_config(mesh.config), "1s", "1s", [str(f) for f in sorted(OBSERVABILITY.glob("*.yaml"))]
        )
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log = workdir / "prometheus.log"
        self.data = workdir / "data"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [
                    str(PROMETHEUS), f"--config.file={self.config_path}", f"--storage.tsdb.path={self.data}",
                    f"--web.listen-address={self.address}", "--storage.tsdb.retention.time=1h",
                ],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_until(self._ready, 30, "Prometheus to be ready", interval=0.2)

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
        try:
            return urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str):
        url = f"http://{self.address}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def firing(self, alertname: str) -> list[dict]:
        return [
            a
            for a in self.api("alerts")["alerts"]
            if a["labels"]["alertname"] == alertname and a["state"] == "firing"
        ]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("obs")
    config = mesh_config(engines=4, engine_args=["--speedup", "20"], policy="kv_affinity")
    config["models"] = [{"name": "tandem-sim"}, {"name": "tandem-pd"}]
    engines = config["node_agents"][0]["engines"]
    engines[1]["args"] += ["--block-size", "128"]  # the mis-configuration: the mesh file says 16
    for engine, (iid, role) in zip(
        engines[2:], [("prefill-0", "prefill"), ("decode-0", "decode")], strict=True
    ):
        engine.update(instance_id=iid, role=role, model="tandem-pd", kv_connector="NixlConnector")
    unmeetable = {"ttft_slo_s": 1e-6, "tpot_slo_s": 1e-6, "max_queued": 1, "queue_ttl_s": 0.5}
    config["coordinator"]["flow_control"] = {"enabled": True, "flex": unmeetable}
    config["coordinator"]["scheduler"]["match_timeout_ms"] = 1000  # a loaded box: no load-only fallbacks
    mesh = RunningMesh(config, workdir)
    mesh.start()
    prometheus = Prometheus(mesh, workdir)
    try:
        prometheus.start()
        load = Load(mesh).start()
        yield mesh, prometheus, load
    finally:
        if "load" in locals():
            load.stop()
        prometheus.stop()
        mesh.stop()


def test_a_misconfigured_block_size_fires_the_hit_error_alert_within_a_minute(observed):
    mesh, prometheus, load = observed
    try:
        alerts = wait_until(
            lambda: prometheus.firing("TandemPredictedHitsNotDelivered"),
            ALERT_WITHIN_S - (time.monotonic() - load.started),
            "TandemPredictedHitsNotDelivered to fire",
            interval=0.5,
        )
    except TimedOut:
        ratio = prometheus.query("tandem:hit_delivery:ratio5m")
        predicted = prometheus.query("tandem:predicted_hit_tokens:rate5m")
        pytest.fail(f"no alert within {ALERT_WITHIN_S}s; ratio {ratio}; predicted {predicted}")
    fired_after = time.monotonic() - load.started
    print(f"TandemPredictedHitsNotDelivered firing {fired_after:.1f}s after the load started")
    assert {a["labels"]["instance"] for a in alerts} == {MISCONFIGURED}, alerts
    assert {a["labels"]["model"] for a in alerts} == {"tandem-sim"}
    # The well-configured engine of the same model delivers what it was routed for.
    healthy = prometheus.query('tandem:hit_delivery:ratio5m{instance="sim-0"}')
    assert healthy and float(healthy[0]["value"][1]) >= 0.5, healthy


def test_every_dashboard_query_returns_series_while_the_mesh_serves(observed):
    mesh, prometheus, load = observed
    panels = json.loads(DASHBOARD.read_text())["panels"]
    queries = [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]
    assert prometheus.query('up{job=~"tandem-.*"} == 0') == []
    empty: list[tuple[str, str]] = []

    def all_answer() -> bool:
        empty[:] = [(title, expr) for title, expr in queries if not prometheus.query(expr)]
        return not empty

    try:
        wait_until(
            all_answer, max(5.0, LOAD_LIMIT_S - (time.monotonic() - load.started)), "every panel's series"
        )
    except TimedOut:
        pytest.fail(f"queries without series: {empty}")
    assert 200 in load.statuses and 429 in load.statuses, sorted(set(load.statuses))
    assert {s for s in load.statuses} <= {200, 429}, sorted(set(load.statuses))
    png = os.environ.get("TANDEM_DASHBOARD_PNG")
    if png:  # docs/operations.md's figure, from these very queries (bench/dashboard.py)
        from bench.dashboard import plot

        plot(prometheus.address, load.started_wall, time.time(), png)
