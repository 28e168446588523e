"""Conductor: the KV index of the mesh. Ingests engine KV events, answers exclusive NPU/CPU/disk prefix hits.

The core (`index`, `match`, `freshness`, `ingest`) is pure Python with no gRPC; `service`, `direct` and `app` are
the I/O shells around it.

The names below are loaded when first used (PEP 562), not when the package is: every `tandem` process reads
`conductor.config` (the mesh file's `conductor:` section) and the coordinator, restarted, must not pay for the
index's import before it serves again. (`conductor.match` is the module: its function is `conductor.match.match`.)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ConductorConfig": "conductor.config",
    "DirectEndpoint": "conductor.config",
    "KvIndex": "conductor.index",
    "IncomingBatch": "conductor.ingest",
    "IngestCore": "conductor.ingest",
    "InstanceHit": "conductor.match",
    "MatchResult": "conductor.match",
    "RankHit": "conductor.match",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'conductor' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
