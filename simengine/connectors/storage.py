"""Shared storage (vLLM's ExampleConnector, ex SharedStorageConnector: its CPU-friendly P/D).

A producer writes every finished prompt's KV (a file sized from its block count) under
`kv_connector_extra_config.shared_storage_path`, keyed by its block-aligned prompt tokens; a consumer that finds
the file for a new request's prompt loads it instead of computing those tokens, whatever the request's
`kv_transfer_params` say. Nothing goes over the network, and answers carry no `kv_transfer_params`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import uuid
from array import array
from typing import TYPE_CHECKING

from simengine.connectors.base import ConnectorBase

if TYPE_CHECKING:
    from simengine.config import EngineConfig
    from simengine.engine import Engine
    from simengine.request import Request

log = logging.getLogger("simengine.connectors")

#: vLLM connector names simulated by this module.
NAMES = ("ExampleConnector", "SharedStorageConnector")


def _read_file(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


class StorageConnector(ConnectorBase):
    """KV through files in a directory producers and consumers share."""

    def __init__(self, cfg: EngineConfig, engine: Engine) -> None:
        super().__init__(cfg, engine)
        extra = self.kt.kv_connector_extra_config
        #: The shared directory (vLLM's `shared_storage_path`).
        self.storage_path = str(extra.get("shared_storage_path") or "/tmp/simengine-kv-storage")

    async def start(self) -> None:
        os.makedirs(self.storage_path, exist_ok=True)

    def prepare(self, request: Request, params: dict | None, callback_id: str) -> None:
        if self.kt.is_consumer and os.path.exists(self._storage_file(request)):
            request.needs_remote_kv = True

    async def complete(self, request: Request) -> dict | None:
        return None

    def finished(self, request: Request) -> None:
        if self.kt.is_producer:
            try:
                self._save(request)
            except OSError as e:
                log.warning("KV save to %s failed: %s", self.storage_path, e)

    def start_transfers(self, requests: list[Request]) -> None:
        for req in requests:
            self._spawn(self._load(req))

    def _storage_tokens(self, request: Request) -> int:
        """Prompt tokens the storage holds for a request: block-aligned, leaving at least one to compute."""
        bs = self.cfg.block_size
        return (request.num_prompt_tokens - 1) // bs * bs

    def _storage_file(self, request: Request) -> str:
        tokens = request.prompt_token_ids[: self._storage_tokens(request)]
        key = hashlib.sha256(array("q", tokens).tobytes()).hexdigest()[:32]
        return os.path.join(self.storage_path, f"{key}.kv")

    def _save(self, request: Request) -> None:
        num = self._storage_tokens(request)
        if num <= 0 or not request.output_token_ids:
            return
        path = self._storage_file(request)
        if os.path.exists(path):
            return
        nbytes = num // self.cfg.block_size * self.cfg.kv_bytes_per_block
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(bytes(nbytes))
        os.replace(tmp, path)  # atomic: a reader never sees a partial file
        self.metrics.kv_transfer_bytes.inc(nbytes)

    async def _load(self, req: Request) -> None:
        try:
            data = await asyncio.to_thread(_read_file, self._storage_file(req))
            self.metrics.kv_transfer_bytes.inc(len(data))
            await self._arrive(req, self._storage_tokens(req))
        except OSError as e:
            log.warning("KV load from %s failed (%s); computing the prompt locally", self.storage_path, e)
            self._fall_back(req)


def create(cfg: EngineConfig, engine: Engine) -> StorageConnector:
    """Factory used by the connector factory."""
    return StorageConnector(cfg, engine)
