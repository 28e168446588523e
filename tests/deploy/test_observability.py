"""deploy/observability: the Prometheus rules pass `promtool check rules` and their unit tests (`promtool test
rules`: every alert fires on its input and stays silent on a near miss); the Grafana dashboard is well formed and
queries only metrics the mesh exports or the rules record; `tandem prometheus-config` scrapes every process of a
mesh file. The live check (a real Prometheus scraping a running mesh) is tests/e2e/test_observability.py."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from mesh.config import parse_mesh_config
from mesh.observability import scrape_config

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "deploy" / "observability"
RULE_FILES = sorted(OBSERVABILITY.glob("*.yaml"))
DASHBOARD = OBSERVABILITY / "tandem-dashboard.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (make system-deps: apt-get install -y prometheus)"
)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def recorded() -> set[str]:
    return {
        r["record"] for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]
        if "record" in r
    }  # fmt: skip


def alerts() -> set[str]:
    return {
        r["alert"] for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]
        if "alert" in r
    }  # fmt: skip


def test_the_top_level_files_are_rule_groups():
    assert RULE_FILES
    for f in RULE_FILES:
        assert list(yaml.safe_load(f.read_text())) == ["groups"], f


@needs_promtool
def test_promtool_accepts_the_rules():
    out = subprocess.run([PROMTOOL, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_every_alert_has_a_unit_test_and_they_pass():
    tests = sorted((OBSERVABILITY / "tests").glob("*.test.yaml"))
    tested = {
        t["alertname"]
        for f in tests
        for case in yaml.safe_load(f.read_text())["tests"]
        for t in case.get("alert_rule_test", [])
        if t.get("exp_alerts")
    }
    assert alerts() <= tested, f"alerts without a firing unit test: {sorted(alerts() - tested)}"
    out = subprocess.run(
        [PROMTOOL, "test", "rules", *map(str, tests)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_dashboard_queries_known_metrics():
    """Every metric a panel reads is one a Tandem process or engine exports, or one the rules record."""

    names = set()
    for title, expr in dashboard_queries():
        assert expr.count("(") == expr.count(")"), title
        names |= {
            m for m in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?=\{|\[| *\)|$)", expr) if "_" in m or ":" in m
        }
    exported = re.compile(r"^(tandem_(coordinator|conductor|node_agent)_|vllm:|ALERTS$)")
    unknown = {n for n in names if not exported.match(n) and n not in recorded()}
    assert not unknown, unknown
    panels = json.loads(DASHBOARD.read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels if p["type"] != "row")


def test_prometheus_config_scrapes_every_process_of_the_mesh_file():
    mesh = parse_mesh_config(
        {
            "coordinator": {"replicas": 2, "etcd": {"endpoint": "127.0.0.1:2379"}},
            "conductor": {"replicas": 2},
            "models": [{"name": "m"}],
            "node_agents": [
                {
                    "node_id": "n1",
                    "engines": [
                        {"instance_id": "a", "model": "m", "port": 8101},
                        {"instance_id": "b", "model": "m", "port": 8110, "role": "prefill",
                         "kv_connector": "NixlConnector", "data_parallel_size": 2, "kv_events_port": 5600},
                    ],
                }
            ],
        }
    )  # fmt: skip
    config = scrape_config(mesh, "1s", "1s", ["rules.yaml"])
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    targets = {
        name: [(t, g.get("labels", {}).get("instance")) for g in j["static_configs"] for t in g["targets"]]
        for name, j in jobs.items()
    }
    assert targets["tandem-coordinator"] == [("127.0.0.1:9101", None), ("127.0.0.1:9111", None)]
    assert targets["tandem-conductor"] == [("127.0.0.1:9201", None), ("127.0.0.1:9211", None)]
    assert targets["tandem-agent"] == [("127.0.0.1:9301", None)]
    assert targets["tandem-engines"] == [
        ("127.0.0.1:8101", "a"), ("127.0.0.1:8110", "b-dp0"), ("127.0.0.1:8111", "b-dp1"),
    ]  # fmt: skip
    # The components' series name engines in their own `instance` label: it must survive the scrape.
    assert all(jobs[j]["honor_labels"] for j in ("tandem-coordinator", "tandem-conductor", "tandem-agent"))
    assert config["rule_files"] == ["rules.yaml"]
    assert config["global"] == {"scrape_interval": "1s", "evaluation_interval": "1s"}
