"""Conductor: the KV index of the mesh. Ingests engine KV events, answers exclusive NPU/CPU/disk prefix hits.

The core (`index`, `match`, `freshness`, `ingest`) is pure Python with no gRPC; `service`, `direct` and `app` are
the I/O shells around it.
"""

from conductor.config import ConductorConfig, DirectEndpoint
from conductor.index import KvIndex
from conductor.ingest import IncomingBatch, IngestCore
from conductor.match import InstanceHit, MatchResult, RankHit, match

__all__ = [
    "ConductorConfig",
    "DirectEndpoint",
    "IncomingBatch",
    "IngestCore",
    "InstanceHit",
    "KvIndex",
    "MatchResult",
    "RankHit",
    "match",
]
