"""bench.tiers_live's setup: the example's keys and listeners moved to free ports (the scenario itself runs in
`python -m bench.tiers_live`, a real-time benchmark)."""

from __future__ import annotations

import yaml

from bench import tiers_live
from bench.tiers_live import EXAMPLE, example_keys, on_free_ports


def test_the_example_keys_name_the_three_tenants():
    keys = example_keys(EXAMPLE.read_text())
    tenants = {t["name"]: t["keys"] for t in yaml.safe_load(EXAMPLE.read_text())["coordinator"]["tenants"]}
    assert set(keys) == {"gold", "free", "tiny"} and all(keys[n] in tenants[n] for n in keys)


def test_every_listener_moves_to_its_own_free_port_and_nothing_else_changes(monkeypatch):
    monkeypatch.setattr(tiers_live, "free_ports", lambda n: list(range(30000, 30000 + n)))
    original = yaml.safe_load(EXAMPLE.read_text())
    moved = on_free_ports(yaml.safe_load(EXAMPLE.read_text()))
    listens = [
        moved["envoy"]["http_listen"], moved["envoy"]["grpc_listen"], moved["envoy"]["callback_listen"],
        moved["coordinator"]["listen"], moved["coordinator"]["metrics_listen"],
        moved["conductor"]["listen"], moved["conductor"]["metrics_listen"],
        *(a[k] for a in moved["node_agents"] for k in ("listen", "metrics_listen")),
        *(f"127.0.0.1:{e['port']}" for a in moved["node_agents"] for e in a["engines"]),
    ]  # fmt: skip
    assert sorted(listens) == [f"127.0.0.1:{port}" for port in range(30000, 30000 + 7 + 2 + 4)]
    assert moved["coordinator"]["tenants"] == original["coordinator"]["tenants"]
    assert moved["coordinator"]["flow_control"] == original["coordinator"]["flow_control"]
