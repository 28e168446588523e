"""Which connector each `--kv-transfer-config` name builds, and how it is wired to the engine loop."""

from __future__ import annotations

import json
import logging

import pytest

from simengine.config import parse_config
from simengine.connectors import factory, mooncake_transport
from simengine.connectors.factory import connector_names, create_connector
from simengine.connectors.handoff import HandoffConnector
from simengine.connectors.mooncake import MooncakeConnector
from simengine.connectors.storage import StorageConnector
from simengine.connectors.trigger import TriggerConnector
from simengine.engine import Engine
from simengine.metrics import EngineMetrics
from simengine.sampler import Sampler


def build(connector: str | None, role: str = "kv_both"):
    argv = []
    if connector is not None:
        argv = ["--kv-transfer-config", json.dumps({"kv_connector": connector, "kv_role": role})]
    cfg = parse_config(argv)
    engine = Engine(cfg, Sampler([1, 2, 3], 0), EngineMetrics("m"))
    return engine, create_connector(cfg, engine)


def test_every_vllm_name_is_accepted_once():
    assert connector_names() == (
        "ExampleConnector",
        "LMCacheConnectorV1",
        "MooncakeConnector",
        "MooncakeConnectorV1",
        "MooncakeLayerwiseConnector",
        "NixlConnector",
        "OffloadingConnector",
        "P2pNcclConnector",
        "SharedStorageConnector",
    )
    with pytest.raises(ValueError, match="registered twice"):
        factory.register(("NixlConnector",), lambda cfg, engine: None)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("NixlConnector", HandoffConnector),
        ("P2pNcclConnector", HandoffConnector),
        ("MooncakeLayerwiseConnector", TriggerConnector),
        ("ExampleConnector", StorageConnector),
        ("SharedStorageConnector", StorageConnector),
    ],
)
def test_each_name_builds_its_connector_wired_to_the_engine(name, kind):
    engine, connector = build(name)
    assert type(connector) is kind
    assert engine.on_remote_kv == connector.start_transfers


@pytest.mark.parametrize("name", [None, "OffloadingConnector", "LMCacheConnectorV1"])
def test_no_connector_without_a_pd_name(name):
    engine, connector = build(name)
    assert connector is None and engine.on_remote_kv is None


def test_mooncake_names_use_the_transfer_engine_when_it_loads(monkeypatch, caplog):
    monkeypatch.setattr(mooncake_transport, "available", lambda: None)
    assert type(build("MooncakeConnectorV1")[1]) is MooncakeConnector
    monkeypatch.setattr(mooncake_transport, "available", lambda: "ImportError: no libibverbs")
    with caplog.at_level(logging.WARNING, "simengine.connectors"):
        assert type(build("MooncakeConnector")[1]) is HandoffConnector
    assert "no libibverbs" in caplog.text and "plain TCP path" in caplog.text
