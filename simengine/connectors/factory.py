"""Explicit registration of the simulated connectors by vLLM connector name, and building the one
`--kv-transfer-config` names."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from simengine.connectors import handoff, mooncake, storage, trigger
from simengine.connectors.interface import KVConnector

if TYPE_CHECKING:
    from simengine.config import EngineConfig
    from simengine.engine import Engine

Factory = Callable[["EngineConfig", "Engine"], KVConnector]
#: vLLM connector names accepted without a connector: they move KV within one engine (offloading), which the
#: simulator's tiers (`--cpu-blocks`, `--offload`) stand for, not between engines.
LOCAL_CONNECTORS = ("OffloadingConnector", "LMCacheConnectorV1")
_FACTORIES: dict[str, Factory] = {}


def register(names: tuple[str, ...], factory: Factory) -> None:
    """Adds a connector under its vLLM names; a duplicate name is an error."""
    for name in names:
        if name in _FACTORIES or name in LOCAL_CONNECTORS:
            raise ValueError(f"KV connector {name!r} is registered twice")
        _FACTORIES[name] = factory


def register_builtin_connectors() -> None:
    """Registers every built-in connector (idempotent). The one list of what simengine simulates."""
    if _FACTORIES:
        return
    register(handoff.NAMES, handoff.create)
    register(trigger.NAMES, trigger.create)
    register(storage.NAMES, storage.create)
    register(mooncake.NAMES, mooncake.create)


def connector_names() -> tuple[str, ...]:
    """Every `kv_connector` value `--kv-transfer-config` accepts, sorted."""
    register_builtin_connectors()
    return tuple(sorted((*_FACTORIES, *LOCAL_CONNECTORS)))


def create_connector(cfg: EngineConfig, engine: Engine) -> KVConnector | None:
    """The connector `cfg.kv_transfer` names, wired to the engine loop; None when it names none or a local one."""
    register_builtin_connectors()
    name = cfg.kv_transfer.kv_connector
    if not name or name in LOCAL_CONNECTORS:
        return None
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unsupported kv_connector {name!r} (known: {', '.join(connector_names())})")
    connector = factory(cfg, engine)
    engine.on_remote_kv = connector.start_transfers
    return connector
